"""What the run folder keeps: a damaged checkpoint is set aside, never counted among the kept
ones nor displacing a good one; a diverged state is never a checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import localclip
from localclip import data
from localclip.cli import main
from localclip.train import RunFolder
from localclip.train.checkpointing import agree_on_checkpoint
from helpers import write_tiny_ptb

FAST = ["--no-progress", "--workers", "2", "--period", "2", "--set", "eval_tokens=2000", "--set", "log_interval=2", "--allow-custom-corpus"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    write_tiny_ptb(folder / data.CORPORA["ptb"].folder, train_lines=600)
    return folder


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def index_dirs(run: Path) -> list[str]:
    return [e["dir"] for e in json.loads((run / "checkpoints" / "latest.json").read_text())["checkpoints"]]


def run_cli(capfd, *argv) -> tuple[int, str]:
    capfd.readouterr()
    code = main(list(argv))
    return code, capfd.readouterr().err


def test_a_damaged_set_of_the_same_step_does_not_displace_the_good_one(tmp_path):
    """The newest set, the start of epoch 1 at step 30, is damaged; the resume falls back to
    step 20 and its next commit, step-30 at the end of the budget, is another name at the same
    step: the damaged set must not be kept beside it in place of step 20."""
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.checkpoints.mkdir()
    for step, name in ((20, "step-20"), (30, "step-30-epoch-1")):
        run.save_worker_checkpoint({"step": torch.tensor(step)}, name, 0)
        run.commit_checkpoint(step, 1, name=name, keep=2)
    assert index_dirs(run.path) == ["step-30-epoch-1", "step-20"]
    damaged = run.checkpoint_file("step-30-epoch-1", 0)
    cut = damaged.read_bytes()[:60]
    damaged.write_bytes(cut)

    def resume():
        entry, state = agree_on_checkpoint(localclip.comm.current(), run, run.checkpoint_sets())
        run.save_worker_checkpoint({"step": torch.tensor(30)}, "step-30", 0)
        run.commit_checkpoint(30, 1, name="step-30", keep=2)
        return entry["dir"], int(state["step"])

    assert localclip.SimulatedWorld(1).run(resume) == [("step-20", 20)]
    assert index_dirs(run.path) == ["step-30", "step-20"]
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.is_dir()) == ["damaged-step-30-epoch-1", "step-20", "step-30"]
    assert (run.checkpoints / "damaged-step-30-epoch-1" / "rank-0.pt").read_bytes() == cut  # kept as it was, for a look


def test_a_resume_past_a_damaged_newest_checkpoint_sets_it_aside_in_one_line_each(tmp_path, root, capfd):
    out = tmp_path / "run"
    flags = [*FAST, "--data-root", str(root), "--out", str(out), "--set", "checkpoint_interval=2"]
    assert main(["train", "ptb-small", "--max-steps", "4", *flags]) == 0
    newest = out / "checkpoints" / "step-4" / "rank-1.pt"
    newest.write_bytes(os.urandom(300))  # overwritten with other bytes: torch's unpickler refuses them
    code, err = run_cli(capfd, "train", "ptb-small", "--max-steps", "6", "--resume", *flags)
    assert code == 0, err
    assert "weights_only" not in err and "issue" not in err and "Traceback" not in err
    assert all(line.startswith("localclip: ") for line in err.splitlines()), err
    assert f"rank 1: cannot read checkpoint {newest}: damaged (" in err
    assert f"set aside the damaged checkpoint {out / 'checkpoints' / 'damaged-step-4'}" in err
    assert (out / "checkpoints" / "damaged-step-4" / "rank-1.pt").is_file()
    assert index_dirs(out) == ["step-6", "step-4"]  # the step-4 written again by the resumed run: whole
    for name in index_dirs(out):
        for rank in (0, 1):
            torch.load(out / "checkpoints" / name / f"rank-{rank}.pt", weights_only=True)


def test_when_every_checkpoint_is_damaged_the_error_is_one_line_and_nothing_moves(tmp_path, root, capfd):
    out = tmp_path / "run"
    flags = [*FAST, "--data-root", str(root), "--out", str(out), "--set", "checkpoint_interval=2"]
    assert main(["train", "ptb-small", "--max-steps", "4", *flags]) == 0
    (out / "summary.json").unlink()  # as a run killed after its last checkpoint leaves it
    for f in (out / "checkpoints").rglob("rank-0.pt"):
        f.write_bytes(b"\x80\x04not a checkpoint" * 8)
    before = digest(out)
    code, err = run_cli(capfd, "train", "ptb-small", "--max-steps", "6", "--resume", *flags)
    assert code == 2
    assert "weights_only" not in err and "issue" not in err and "Traceback" not in err
    lines = [line for line in err.splitlines() if "canonical" not in line]  # the custom corpus's warnings
    assert len([line for line in lines if line.startswith("localclip: error:")]) == 1 and lines[-1].startswith("localclip: error:")
    assert "no checkpoint" in lines[-1] and "step-4" in lines[-1] and "step-2" in lines[-1]
    assert all(line.startswith("localclip: warning: rank 0: cannot read checkpoint") for line in lines[:-1]) and len(lines) == 3, err
    assert digest(out) == before


def test_a_diverged_run_writes_no_checkpoint_of_its_diverged_state(tmp_path, root, capfd):
    out = tmp_path / "run"
    code, err = run_cli(capfd, "train", "ptb-small", "--lr", "1e9", "--gamma", "inf", "--max-steps", "4",
                        *FAST, "--data-root", str(root), "--out", str(out))
    assert code == 3, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_at_step"] == 4
    written = list((out / "checkpoints").rglob("*.pt"))
    sets = index_dirs(out) if (out / "checkpoints" / "latest.json").exists() else []
    assert written == [] and sets == []


def test_a_run_that_trains_on_after_diverging_checkpoints_nothing_after_that(tmp_path, root, capfd):
    """stop_on_divergence=false: the run goes to the end of its budget; the epoch-start checkpoint
    that follows a validation that found the model diverged is not written either."""
    out = tmp_path / "run"
    code, err = run_cli(capfd, "train", "ptb-small", "--lr", "1e9", "--gamma", "inf", "--epochs", "1", "--set", "stop_on_divergence=false",
                        "--set", "checkpoint_interval=100000", *FAST, "--data-root", str(root), "--out", str(out))
    assert code == 3, err
    assert list((out / "checkpoints").rglob("*.pt")) == []
