"""Partial participation at scale: idle non-participants (K slots play the N workers), and the
refusal of a run whose memory estimate exceeds what the machine has available."""

import json
import threading

import pytest

from localclip.cli import main
from localclip.errors import ConfigError
from localclip.recipes import get_recipe
from localclip.train import capacity, run_training, trainer
from localclip.train.config import flat_view
from localclip.algorithms import build
from helpers import CUSTOM, SHARED, SMOKE_DATA

SMOKE = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=500", "--set", "loggers=[]"]


def smoke_config(**changes):
    return get_recipe("ptb-small").replace(data_root=str(SHARED), allow_custom_corpus=CUSTOM,
                               eval_tokens=500, loggers=[], **changes)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("localclip: error")]


def test_a_run_beyond_the_machines_memory_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--workers", "100000", "--out", str(out), *SMOKE])
    err = capsys.readouterr().err
    assert code == 2
    assert len(error_lines(err)) == 1 and "Traceback" not in err
    line = error_lines(err)[0]
    assert "Invalid workers: 100000" in line and "100000 workers in memory" in line and "available" in line
    assert not out.exists()


def test_the_refusal_names_the_estimate_and_the_limit_and_idle_non_participants_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity, "available_memory", lambda: 1 << 30)  # a 1 GiB machine
    each = capacity.worker_bytes(smoke_config())
    config = smoke_config(workers=64, participants=2)
    with pytest.raises(ConfigError) as refused:
        run_training(config, tmp_path / "run", progress=False)
    message = str(refused.value)
    need = (64 * each + capacity.PROCESS_BYTES) / (1 << 30)
    assert f"about {need:.1f} GiB" in message and "1.0 GiB this machine has available" in message
    assert "non_participants=idle" in message and "\n" not in message
    assert not (tmp_path / "run").exists()
    # The same run with idle non-participants holds 2 workers, which the estimate lets through.
    capacity.check_memory(config.replace(non_participants="idle"), "simulate")


@pytest.mark.parametrize("changes,needle", [
    (dict(workers=8), "needs partial participation"),
    (dict(workers=8, participants=8), "needs partial participation"),
    (dict(workers=8, participants=2, momentum=0.9), "optimizer_state=average or reset"),
    (dict(workers=8, participants=2, compression="int8"), "error_feedback=false"),
    (dict(workers=8, participants=2, algorithm="episode"), "algorithm=celgc|local-sgd"),
    (dict(workers=8, participants=2, fragments=2), "fragments=1"),
])
def test_idle_non_participants_refuse_what_would_give_a_worker_state_of_its_own(changes, needle):
    with pytest.raises(ConfigError, match="non_participants") as refused:
        build.validate(smoke_config(non_participants="idle", **changes))
    assert needle in str(refused.value)


def test_idle_non_participants_run_only_in_the_simulator(tmp_path):
    with pytest.raises(ConfigError, match="use simulate"):
        run_training(smoke_config(workers=8, participants=2, non_participants="idle"), tmp_path / "run", runtime="spawn")
    assert not (tmp_path / "run").exists()


def gpt_config(**changes):
    # A model without recurrent state and without dropout: a non-participant's training then
    # leaves nothing behind once the average replaces its model.
    return smoke_config(model="gpt", model_options=dict(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0),
                        bptt=16, eval_bptt=16, workers=8, participants=3, period=4, max_steps=13, log_interval=5, **changes)


def test_idle_non_participants_end_at_the_model_of_non_participants_that_train(tmp_path):
    """Where training leaves a non-participant nothing of its own, the K slots give the model of
    the N threads bit for bit (13 steps: three rounds and the final, partial period's)."""
    trained = run_training(gpt_config(), tmp_path / "train", progress=False)
    idle = run_training(gpt_config(non_participants="idle"), tmp_path / "idle", progress=False)
    assert trained["comm/rounds"] == idle["comm/rounds"] == 4
    assert idle["model/sha256"] == trained["model/sha256"]
    # The evaluation is split over 3 slots instead of 8 workers: the same model, summed otherwise.
    assert idle["val/ppl"] == pytest.approx(trained["val/ppl"], rel=1e-6)


def test_a_thousand_workers_run_as_the_sampled_few(tmp_path, monkeypatch):
    built, threads = [], []
    init, step = trainer.Trainer.__init__, trainer.Trainer.train_step

    def counting_init(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    def counting_step(self, *args, **kwargs):
        threads.append(threading.active_count())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Trainer, "__init__", counting_init)
    monkeypatch.setattr(trainer.Trainer, "train_step", counting_step)
    before = threading.active_count()
    config = smoke_config(workers=1000, participants=4, non_participants="idle", batch_size=1, period=2, max_steps=6, epochs=6.0)
    summary = run_training(config, tmp_path / "run", progress=False)
    assert summary["workers"] == 1000 and summary["steps"] == 6
    assert len(built) == 4  # four workers in memory, not a thousand
    assert max(threads) <= before + 4
    saved = flat_view(json.loads((tmp_path / "run" / "config.json").read_text()))
    assert saved["workers"] == 1000 and saved["non_participants"] == "idle"


def test_an_idle_run_extended_equals_the_straight_run(tmp_path):
    """A resume restores the played worker's position, recurrent state and dropout stream (the
    LSTM carries state, and dropout draws)."""
    args = ["--workers", "12", "--period", "3", "--set", "participants=3", "--set", "non_participants=idle",
            "--set", "checkpoint_interval=4", "--set", "model_options.dropout=0.3", "--set", "log_interval=2", *SMOKE]
    assert main(["train", "ptb-small", *args, "--max-steps", "14", "--out", str(tmp_path / "straight")]) == 0
    assert main(["train", "ptb-small", *args, "--max-steps", "7", "--out", str(tmp_path / "ext")]) == 0
    assert main(["train", "ptb-small", *args, "--max-steps", "14", "--resume", "--out", str(tmp_path / "ext")]) == 0

    def summary(run):
        return {k: v for k, v in json.loads((run / "summary.json").read_text()).items() if not k.startswith("time/")}

    assert summary(tmp_path / "ext") == summary(tmp_path / "straight")
