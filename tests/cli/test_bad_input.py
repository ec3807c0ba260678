"""Bad input: a clear message naming the problem, exit status 2, and nothing lost."""

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest

from localclip.cli import main

from helpers import SHARED, SMOKE, needs_real_ptb



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
        (["--compression", "int2"], "'int2'"),
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


@needs_real_ptb  # the canonical files, one of them changed
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


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--max-steps", "3"], "--max-steps 3 does not extend it"),  # the same budget
        (["--max-steps", "2"], "--max-steps 2 does not extend it"),  # a smaller one
    ],
)
def test_resume_of_a_finished_run_without_a_larger_budget_is_refused_and_untouched(capsys, finished_run, flags, needle):
    before = digest(finished_run)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--resume", "--out", str(finished_run), *flags, *SMOKE)
    assert code == 2 and "finished" in err and needle in err and "3 steps" in err, err
    assert digest(finished_run) == before


def test_resume_with_a_budget_below_the_last_checkpoint_is_refused_and_untouched(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "4", "--set", "checkpoint_interval=2", "--out", str(out), *SMOKE]) == 0
    (out / "summary.json").unlink()  # as if it had died during the final evaluation
    before = digest(out)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "3", "--resume", "--out", str(out), *SMOKE)
    assert code == 2 and "--max-steps 3 is smaller than the 4 steps" in err and "nothing changed" in err, err
    assert digest(out) == before


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--workers", "3"], ["workers: 2 in the run, 3 now"]),
        (["--algorithm", "naive"], ["algorithm: 'celgc' in the run, 'naive' now"]),
        (["--period", "4"], ["period: 8 in the run, 4 now"]),
        (["--set", "model=awd_lstm"], ["model: 'lstm' in the run, 'awd_lstm' now"]),
        (["--set", "dataset=wikitext2"], ["dataset: 'ptb' in the run, 'wikitext2' now"]),
        (["--workers", "3", "--period", "4"], ["workers: 2 in the run, 3 now", "period: 8 in the run, 4 now"]),
    ],
)
def test_resume_with_another_setup_names_each_field_with_both_values(capsys, finished_run, flags, named):
    before = digest(finished_run)
    workers = [] if "--workers" in flags else ["--workers", "2"]
    code, err = run_cli(capsys, "train", "ptb-small", "--resume", "--max-steps", "6", "--out", str(finished_run), *workers, *flags, *SMOKE)
    assert code == 2 and "differs from the run" in err, err
    for text in named:
        assert text in err, err
    assert "holds a finished run" not in err  # the mismatch is the problem, not the finished state
    assert digest(finished_run) == before


def test_out_naming_an_existing_file_is_refused_and_untouched(capsys, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    code, err = run_cli(capsys, "train", "ptb-small", "--out", str(out), *SMOKE)
    assert code == 2 and str(out) in err and "is a file" in err and "Traceback" not in err
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model_options.nonsense=3", "'nonsense'"),
        ("model_options.dropout=1.5", "dropout"),
        ("threads=0", "threads"),
        ("lr_decay_epochs=[0.5,0.2]", "increasing order"),
        ("lr_decay_epochs=[-1]", "lr_decay_epochs"),
        ("keep_checkpoints=0", "keep_checkpoints"),
        ("stop_on_divergence=maybe", "stop_on_divergence"),
    ],
)
def test_bad_settings_are_refused_before_any_run_folder_exists(capsys, tmp_path, override, needle):
    out = tmp_path / "run"
    code, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "1", "--set", override, "--out", str(out), *SMOKE)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not out.exists()


def test_the_corrected_command_runs_after_a_refused_one(capsys, tmp_path):
    out = tmp_path / "run"
    code, err = run_cli(capsys, "train", "ptb-small", "--max-steps", "1", "--set", "model_options.nonsense=3", "--out", str(out), *SMOKE)
    assert code == 2 and not out.exists()
    assert main(["train", "ptb-small", "--workers", "1", "--max-steps", "1", "--out", str(out), *SMOKE]) == 0


def test_bad_settings_on_resume_leave_the_run_untouched(capsys, finished_run):
    before = digest(finished_run)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--resume", "--max-steps", "6", "--set", "model_options.nonsense=3",
                        "--out", str(finished_run), *SMOKE)
    assert code == 2 and "'nonsense'" in err
    assert digest(finished_run) == before


def test_no_checkpoint_that_loads_everywhere_names_the_files_and_changes_nothing(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "4", "--set", "checkpoint_interval=2", "--out", str(out), *SMOKE]) == 0
    (out / "summary.json").unlink()
    for f in (out / "checkpoints").rglob("rank-1.pt"):
        f.write_bytes(f.read_bytes()[:100])
    before = digest(out)
    code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "6", "--resume", "--out", str(out), *SMOKE)
    assert code == 2 and "no checkpoint" in err and "step-4" in err and "step-2" in err, err
    assert "rank 1: cannot read checkpoint" in err and str(out / "checkpoints" / "step-4" / "rank-1.pt") in err
    assert digest(out) == before


@needs_real_ptb  # the canonical valid and test files beside a custom train file
def test_custom_corpus_folder_as_data_root_warns_once_in_one_line(capsys, tmp_path):
    root = tmp_path / "mycorpus"  # not named like the canonical folder
    root.mkdir()
    for split in ("train", "valid", "test"):
        text = (SHARED / "ptbdataset" / f"{split}.txt").read_text()
        (root / f"{split}.txt").write_text(text[: len(text) // 20] if split == "train" else text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "2", "--allow-custom-corpus",
                            "--out", str(tmp_path / "run"), "--no-progress", "--set", "eval_tokens=2000", "--data-root", str(root))
    assert code == 0, err
    sha = hashlib.sha256((root / "train.txt").read_bytes()).hexdigest()
    lines = [line for line in err.splitlines() if "canonical" in line]
    assert lines == [f"localclip: warning: {root / 'train.txt'} differs from the canonical ptb train.txt (sha256 {sha}); "
                     "results are not comparable with the paper's"], err
    assert "UserWarning" not in err and "ptbdataset" not in err
    assert not [w for w in caught if "canonical" in str(w.message)]


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
    assert code == 2 and "outer_optimizer: 'nesterov' in the run, 'sgd' now" in err and "Traceback" not in err
    assert digest(out) == before


def test_a_run_folder_in_use_by_another_process_is_refused_and_left_as_it_is(capsys, tmp_path, finished_run):
    """The folder lock: a second run or resume into a folder that a running process holds."""
    from localclip.train import RunFolder

    running = tmp_path / "running"
    shutil.copytree(finished_run, running)
    before = digest(running)
    holder = RunFolder(running)
    holder.claim()  # stands for the process that is running it (flock: another open file description conflicts)
    try:
        code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "6", "--resume", "--out", str(running), *SMOKE)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert f"{running} is in use by another localclip process" in err
        fresh = tmp_path / "fresh"  # a fresh run whose folder the other process has just made
        fresh.mkdir()
        other = RunFolder(fresh)
        other.claim()
        code, err = run_cli(capsys, "train", "ptb-small", "--workers", "2", "--max-steps", "3", "--out", str(fresh), *SMOKE)
        assert code == 2 and "in use by another localclip process" in err and list(fresh.iterdir()) == []
        other.release()
    finally:
        holder.release()
    assert digest(running) == before
    # Once the holder has let go, the resume goes on.
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "6", "--resume", "--out", str(running), *SMOKE]) == 0
    assert json.loads((running / "summary.json").read_text())["steps"] == 6
