"""Idle non-participants from the command line: every setting that would give a worker state of
its own (or that the K slots cannot play) is refused in one line before anything is written, and
what every worker shares (the outer optimizer's anchor and momentum) is kept by each slot."""


import pytest

from localclip.cli import main
from localclip.recipes import get_recipe
from localclip.train import run_training
from helpers import CUSTOM, SHARED, SMOKE_DATA

IDLE = ["--workers", "8", "--set", "participants=2", "--set", "non_participants=idle", "--max-steps", "2"]
SMOKE = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=500", "--set", "loggers=[]"]


@pytest.mark.parametrize("argv,needle", [
    # per-worker state between a worker's periods
    (["--set", "momentum=0.9"], "optimizer_state=average or reset"),
    (["--inner-optimizer", "adamw", "--lr", "0.003"], "optimizer_state=average or reset"),
    (["--compression", "int8"], "error_feedback=false"),
    (["--compression", "int4"], "error_feedback=false"),
    (["--fragments", "2"], "fragments=1"),
    (["--overlap", "1"], "overlap=0"),
    (["--algorithm", "episode"], "algorithm=celgc|local-sgd"),
    # what the slots cannot play
    (["--algorithm", "naive"], "participants"),
    (["--runtime", "spawn"], "use simulate"),
    (["--set", "participants=8"], "needs partial participation"),
])
def test_each_refusal_is_one_line_with_exit_2_and_no_folder(tmp_path, capsys, argv, needle):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", *IDLE, *argv, "--out", str(out), *SMOKE])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("localclip: error") and needle in lines[0], err
    assert not out.exists()


@pytest.mark.full
def test_a_refused_resume_leaves_the_run_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", *IDLE, "--out", str(out), *SMOKE]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = main(["train", "ptb-small", *IDLE, "--set", "momentum=0.9", "--max-steps", "4", "--resume", "--out", str(out), *SMOKE])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "non_participants" in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def gpt_config(**changes):
    # As in test_idle_participants: no recurrent state, no dropout, so a non-participant that
    # trains keeps nothing once the average replaces its model.
    return get_recipe("ptb-small").replace(
        data_root=str(SHARED), allow_custom_corpus=CUSTOM, eval_tokens=500, loggers=[],
        model="gpt", model_options=dict(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0),
        bptt=16, eval_bptt=16, workers=8, participants=3, period=4, max_steps=13, log_interval=5, **changes)


@pytest.mark.full
def test_the_outer_optimizer_state_is_shared_so_idle_slots_end_at_the_model_of_training_non_participants(tmp_path):
    """DiLoCo's anchor and outer momentum follow from the participants' average, the same on
    every worker: each slot keeps them, and the run ends at the bits of N training workers."""
    outer = dict(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    trained = run_training(gpt_config(**outer), tmp_path / "train", progress=False)
    idle = run_training(gpt_config(non_participants="idle", **outer), tmp_path / "idle", progress=False)
    plain = run_training(gpt_config(non_participants="idle"), tmp_path / "plain", progress=False)
    assert idle["model/sha256"] == trained["model/sha256"]
    assert idle["model/sha256"] != plain["model/sha256"]  # the outer step did act
