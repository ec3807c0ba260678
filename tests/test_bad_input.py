"""Bad input: a clear message naming the problem, exit status 2, and nothing lost."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from localclip.cli import main

from test_train import SHARED, SMOKE

pytestmark = pytest.mark.skipif(not (SHARED / "ptbdataset" / "train.txt").exists(), reason="PTB corpus not found")


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "3", "--out", str(out), *SMOKE]) == 0
    return out


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse rejects bad flag values itself
        code = exc.code
    return code, capsys.readouterr().err


def test_unknown_recipe_names_it_and_lists_the_recipes(capsys):
    code, err = run_cli(capsys, "train", "ptb-huge")
    assert code == 2 and "ptb-huge" in err and "ptb-small" in err and "wt2-awd" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--period", "0"], "--period"),
        (["--workers", "-3"], "--workers"),
        (["--lr", "abc"], "--lr"),
        (["--gamma", "-1"], "--gamma"),
        (["--epochs", "nan"], "--epochs"),
        (["--set", "participants=9"], "participants"),
        (["--set", "no_such_key=1"], "no_such_key"),
        (["--set", "max_steps=lots"], "max_steps"),
        (["--set", "clip_mode=global"], "clip_mode"),
        (["--runtime", "mpi"], "--runtime"),
        (["--outer-optimizer", "adam"], "'adam'"),
        (["--compression", "int8"], "'int8'"),
        (["--outer-optimizer", "sgd", "--outer-lr", "0"], "outer_lr: 0.0"),
        (["--outer-optimizer", "nesterov", "--outer-lr", "-0.5"], "outer_lr: -0.5"),
        (["--outer-optimizer", "sgd", "--outer-momentum", "1"], "outer_momentum: 1.0"),
        (["--outer-optimizer", "sgd", "--outer-momentum", "-0.1"], "outer_momentum: -0.1"),
        (["--outer-optimizer", "nesterov", "--outer-momentum", "0"], "outer_momentum: 0.0"),
        (["--algorithm", "episode", "--set", "clip_mode=max"], "clip_mode: 'max'"),
        (["--algorithm", "naive", "--outer-optimizer", "nesterov"], "outer_optimizer: 'nesterov'"),
        (["--algorithm", "naive", "--compression", "bf16"], "compression: 'bf16'"),
    ],
)
def test_invalid_flag_values_name_the_flag(capsys, tmp_path, flags, needle):
    code, err = run_cli(capsys, "train", "ptb-small", "--out", str(tmp_path / "x"), "--data-root", str(SHARED), *flags)
    assert code == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_missing_data_names_the_path_and_the_download_command(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "ptb-small", "--data-root", str(tmp_path / "empty"), "--out", str(tmp_path / "run"))
    assert code == 2
    assert str(tmp_path / "empty") in err and "localclip data download ptb" in err
    assert not (tmp_path / "run").exists()


def test_checksum_mismatch_names_the_file(capsys, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(SHARED / "ptbdataset", root / "ptbdataset")
    valid = root / "ptbdataset" / "valid.txt"
    valid.write_bytes(valid.read_bytes().replace(b" the ", b" teh ", 1))
    code, err = run_cli(capsys, "train", "ptb-small", "--data-root", str(root), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert code == 2 and "valid.txt" in err and "--allow-custom-corpus" in err


def test_existing_run_without_resume_is_refused_and_untouched(capsys, finished_run):
    before = digest(finished_run)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "3", "--out", str(finished_run), *SMOKE)
    assert code == 2 and str(finished_run) in err and "finished" in err
    assert digest(finished_run) == before


def test_resume_of_a_finished_run_is_refused_and_untouched(capsys, finished_run):
    before = digest(finished_run)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "6", "--resume", "--out", str(finished_run), *SMOKE)
    assert code == 2 and "finished" in err
    assert digest(finished_run) == before


def test_resume_with_other_workers_names_both(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"workers": 4, "algorithm": "celgc"}))
    before = digest(out)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--resume", "--out", str(out), *SMOKE)
    assert code == 2 and "2 workers" in err and "4" in err
    assert digest(out) == before


def test_started_run_without_resume_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    code, err = run_cli(capsys, "train", "ptb-small", "--out", str(out), *SMOKE)
    assert code == 2 and "--resume" in err and str(out) in err


def test_plot_of_a_folder_that_is_not_a_run(capsys, tmp_path):
    code, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(tmp_path / "f.png"))
    assert code == 2 and str(tmp_path) in err
    assert not (tmp_path / "f.png").exists()


def test_resume_with_another_outer_optimizer_names_both_and_changes_nothing(capsys, tmp_path):
    out = tmp_path / "run"
    flags = ["--workers", "2", "--period", "2", "--max-steps", "2", "--set", "checkpoint_interval=1", *SMOKE]
    assert main(["train", "ptb-small", "--outer-optimizer", "nesterov", "--out", str(out), *flags]) == 0
    (out / "summary.json").unlink()  # a started run with checkpoints, as if interrupted
    before = digest(out)
    code, err = run_cli(capsys, "train", "ptb-small", "--outer-optimizer", "sgd", "--resume", "--out", str(out), *flags)
    assert code == 2 and "outer_optimizer: 'nesterov' -> 'sgd'" in err and "Traceback" not in err
    assert digest(out) == before
