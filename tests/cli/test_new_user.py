"""What a new user meets: failures that say so and leave nothing behind, help that covers every
option, result files that strict JSON parsers read, and the progress display."""

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from localclip import data, jsonio
from localclip.cli import EXIT_DIVERGED, main
from localclip.errors import DataError
from localclip_lab.plans import SWEEPS
from localclip.recipes import RECIPES, get_recipe
from localclip.train import trainer as trainer_module
from localclip.train import workloads
from helpers import REPO, SMOKE_DATA

SMOKE = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000", "--set", "log_interval=2", "--workers", "2", "--period", "2"]


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (--help, --version, bad flag values)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(text: str):
    """json.loads that refuses Infinity and NaN, as strict parsers do."""
    def refuse(word):
        raise ValueError(f"non-standard JSON constant {word}")

    return json.loads(text, parse_constant=refuse)


# -- a diverged run --------------------------------------------------------------------------------


def test_a_diverged_run_says_so_with_its_own_exit_status_and_writes_standard_json(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "ptb-small", "--algorithm", "local-sgd", "--lr", "1e6", "--max-steps", "4",
                                "--out", str(out), *SMOKE)
    assert code == EXIT_DIVERGED == 3, err
    line = stdout.strip().splitlines()[-1]
    summary = strict_json((out / "summary.json").read_text())
    assert line.startswith(f"diverged {out}: the validation at step {summary['diverged_at_step']} found the model diverged")
    assert summary["val/ppl"] in ("inf", "nan") and summary["diverged_at_step"] == 4
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["final"] and records[-1]["val/ppl"] in ("inf", "nan")
    config = strict_json((out / "config.json").read_text())
    assert config["local"]["gamma"] == "inf"  # local SGD: no clipping
    assert math.isinf(jsonio.loads((out / "config.json").read_text())["local"]["gamma"])


def test_under_torchrun_a_diverged_run_exits_0_so_that_the_agent_does_not_restart_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # what torchrun sets for its workers
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "ptb-small", "--algorithm", "local-sgd", "--lr", "1e6", "--max-steps", "2",
                                "--out", str(out), *SMOKE)
    assert code == 0, err
    assert stdout.strip().splitlines()[-1].startswith(f"diverged {out}: the validation at step 2 found the model diverged")


def test_a_run_that_trained_on_after_diverging_names_the_first_diverged_validation(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(capsys, "train", "ptb-small", "--algorithm", "local-sgd", "--lr", "1e6", "--max-steps", "8",
                              "--set", "eval_interval=2", "--set", "stop_on_divergence=false", "--out", str(out), *SMOKE)
    assert code == EXIT_DIVERGED
    records = [jsonio.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r["step"] for r in records if "val/ppl" in r and not math.isfinite(r["val/ppl"]))
    assert f"the validation at step {first} found the model diverged" in stdout.strip().splitlines()[-1]


def test_the_json_readers_take_both_encodings():
    assert jsonio.loads('{"a": Infinity, "b": -Infinity, "c": [NaN, 1.5]}')["a"] == math.inf
    decoded = jsonio.loads('{"a": "inf", "b": "-inf", "c": ["nan", 1.5], "d": "celgc"}')
    assert decoded["a"] == math.inf and decoded["b"] == -math.inf and math.isnan(decoded["c"][0]) and decoded["d"] == "celgc"
    assert jsonio.dumps({"x": [math.inf, -math.inf, math.nan, 2.0]}) == '{"x": ["inf", "-inf", "nan", 2.0]}'


def test_committed_results_with_infinity_still_read():
    from localclip_lab.reports.runs import load_finished
    from localclip.plot import load_run

    folder = REPO / "results" / "ptb-6ep" / "earlier-code" / "converge" / "local-sgd-I8-lr20"
    assert "Infinity" in (folder / "summary.json").read_text()  # written before the strict encoding
    run = load_finished(folder)
    assert run["summary"]["val/ppl"] == math.inf and run["config"]["gamma"] == math.inf
    plotted = load_run(folder)
    assert plotted["config"]["gamma"] == math.inf and any(r.get("val/ppl") == math.inf for r in plotted["eval"])


# -- start-up failures leave nothing behind --------------------------------------------------------


@pytest.mark.parametrize("out", ["/proc/localclip-test/run", "FILE/below"])
def test_an_unwritable_out_is_one_line_naming_it(tmp_path, capsys, out):
    (tmp_path / "FILE").write_text("a regular file")
    out = out.replace("FILE", str(tmp_path / "FILE"))
    code, _, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "1", "--out", out, *SMOKE)
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert line.startswith(f"localclip: error: --out {out}: cannot write the run folder there")
    assert not Path(out).exists() and (tmp_path / "FILE").read_text() == "a regular file"


def test_a_run_failing_at_start_up_leaves_no_folder_and_the_retry_runs(tmp_path, capsys, monkeypatch):
    real = workloads.LMWorkload.__init__
    calls = []

    def fails_once(self, config, comm, *args, **kwargs):
        calls.append(comm.rank)
        if len(calls) <= 2:  # both workers of the first attempt
            raise DataError("a dependency is missing (simulated)")
        real(self, config, comm, *args, **kwargs)

    monkeypatch.setattr(workloads.LMWorkload, "__init__", fails_once)
    out = tmp_path / "deeper" / "run"
    code, _, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "2", "--out", str(out), *SMOKE)
    assert code == 2 and "a dependency is missing" in err
    assert not (tmp_path / "deeper").exists()
    code, _, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "2", "--out", str(out), *SMOKE)
    assert code == 0, err
    assert (out / "summary.json").exists()


def test_an_image_run_without_its_data_or_dependency_writes_nothing(tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, "train", "fmnist-resnet", "--set", f"data_root={tmp_path / 'no-fmnist'}", "--out", str(tmp_path / "f"))
    assert code == 2 and "dataset-fashion-mnist" in err and str(tmp_path / "no-fmnist") in err
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else find_spec(name, *a))
    code, _, err = run_cli(capsys, "train", "cifar10-resnet32", "--out", str(tmp_path / "c"))
    assert code == 2 and "pip install torchvision" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_data_root_that_does_not_exist_is_refused_not_created(tmp_path, capsys):
    typo = tmp_path / "dtaa"
    code, _, err = run_cli(capsys, "train", "ptb-small", "--data-root", str(typo), "--out", str(tmp_path / "run"))
    assert code == 2 and f"--data-root {typo} does not exist" in err and f"localclip data download ptb --data-root {typo}" in err
    assert not typo.exists() and not (tmp_path / "run").exists()


def test_a_failed_download_removes_the_folders_it_created(tmp_path):
    root = tmp_path / "new" / "root"
    with pytest.raises(DataError, match="Could not download"):
        data.download_corpus("ptb", root, progress=None, base_url=(tmp_path / "no-mirror").as_uri())
    assert not (tmp_path / "new").exists()


def test_resume_of_a_folder_without_a_run_says_it_starts_fresh(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "2", "--resume", "--out", str(out), *SMOKE)
    assert code == 0 and f"--resume: {out} holds no run yet; starting a fresh run there" in err
    assert (out / "summary.json").exists()


# -- the progress display --------------------------------------------------------------------------


def test_a_resumed_bar_counts_only_the_steps_done_now():
    bar = tqdm(total=100, file=io.StringIO(), mininterval=0)
    time.sleep(0.05)
    trainer_module._resume_bar(bar, 60)
    bar.update(1)
    meter = bar.format_dict
    # 1 step since the resume, not 61: the rate (and the ETA) come from n - initial over elapsed.
    assert meter["n"] - meter["initial"] == 1 and meter["elapsed"] < 0.05
    bar.close()


# -- help ------------------------------------------------------------------------------------------


def test_version(capsys):
    from localclip import __version__

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"localclip {__version__}"


def test_every_train_option_has_help_and_a_default(capsys):
    from localclip.cli import _parser

    parser = _parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        if action.dest in ("help", "recipe"):
            continue
        assert action.help, action.dest
        assert "default" in action.help, f"{action.option_strings}: {action.help}"
    code, out, _ = run_cli(capsys, "train", "--help")
    assert code == 0 and f"{EXIT_DIVERGED}    the run finished with a diverged model" in out


def test_sweep_help_lists_every_sweep(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside hyphenated names
    code, out, _ = run_cli(capsys, "sweep", "--help")
    text = " ".join(out.split())
    assert code == 0 and "one after another" not in text
    for name in SWEEPS:
        assert name in text, name
    readme = (REPO / "README.md").read_text()
    for name in SWEEPS:
        assert f"`{name}`" in readme or f" {name}" in readme, name


def test_recipes_fields_shows_each_recipes_own_values(capsys):
    code, out, _ = run_cli(capsys, "recipes", "--fields")
    assert code == 0
    lr = next(line for line in out.splitlines() if line.strip().startswith("lr"))
    for name in RECIPES:
        assert name in lr and repr(get_recipe(name).local.lr) in lr, (name, lr)
    code, out, _ = run_cli(capsys, "recipes", "ptb-small", "--fields")
    assert "  lr = 20.0" in out and "  batch_size = 5" in out


def test_docs_refer_to_nothing_outside_the_repository():
    texts = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    from localclip.cli import _parser

    buf = io.StringIO()
    parser = _parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        buf.write(sub.format_help())
    texts["help"] = buf.getvalue()
    for where, text in texts.items():
        for needle in ("ALGORITHM.md", "../shared", "shared/data", "install from disk"):
            assert needle not in text, f"{where} mentions {needle}"
