"""Continuing runs: a finished run extended with a larger budget, and a resume that falls back to
an older checkpoint when the newest does not load. Each must equal the straight run."""

import json
from pathlib import Path

import pytest

from localclip.cli import main

from helpers import SHARED, SMOKE, assert_same_run, timeless_records, timeless_summary


ARGS = ["--workers", "2", "--period", "3", "--set", "checkpoint_interval=5"]


def train(out: Path, *args) -> None:
    assert main(["train", "ptb-small", *ARGS, *args, "--out", str(out), *SMOKE]) == 0


@pytest.fixture(scope="module")
def straight40(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    train(out, "--max-steps", "40")
    return out


def test_a_finished_run_extended_equals_the_straight_run(tmp_path, straight40):
    out = tmp_path / "run"
    train(out, "--max-steps", "20")
    assert timeless_summary(out)["steps"] == 20 and any(r.get("final") for r in timeless_records(out))
    train(out, "--max-steps", "40", "--resume")
    assert_same_run(out, straight40)  # no trace of the first run's final averaging or evaluation


def test_the_last_checkpoints_are_kept(tmp_path):
    out = tmp_path / "run"
    train(out, "--max-steps", "12", "--set", "keep_checkpoints=3")
    index = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [12, 10, 5]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step-10", "step-12", "step-5"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, straight40, capfd):
    out = tmp_path / "run"
    train(out, "--max-steps", "20")
    newest = out / "checkpoints" / "step-20" / "rank-1.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a truncated file, as a full disk leaves it
    capfd.readouterr()
    train(out, "--max-steps", "40", "--resume")
    err = capfd.readouterr().err
    assert f"rank 1: cannot read checkpoint {newest}" in err
    assert "resuming from the older checkpoint step-15" in err
    assert_same_run(out, straight40)


@pytest.mark.full  # spawned processes
def test_a_finished_run_extended_equals_the_straight_run_under_spawn(tmp_path):
    spawn = ["--runtime", "spawn", "--set", "threads=1"]
    train(tmp_path / "straight", "--max-steps", "16", *spawn)
    train(tmp_path / "run", "--max-steps", "8", *spawn)
    train(tmp_path / "run", "--max-steps", "16", "--resume", *spawn)
    assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """PTB with 1/150 of its training text: an epoch of a dozen steps, so epochs can be extended."""
    root = tmp_path_factory.mktemp("tiny") / "ptbdataset"
    root.mkdir()
    for split in ("train", "valid", "test"):
        lines = (SHARED / "ptbdataset" / f"{split}.txt").read_text().splitlines(keepends=True)
        # 1/150 of PTB's training lines (280); as many from the tests' small corpus
        (root / f"{split}.txt").write_text("".join(lines[: max(len(lines) // 150, 280)] if split == "train" else lines))
    return root


@pytest.mark.parametrize("first,then", [("1", "2"), ("1.5", "2.5")])
def test_more_epochs_continue_a_finished_run_as_a_straight_run(tmp_path, tiny_corpus, first, then):
    """Ending at an epoch boundary (checkpoint after the epoch's evaluation) and inside an epoch
    (checkpoint before the final averaging) both continue exactly."""
    tiny = ["--allow-custom-corpus", "--data-root", str(tiny_corpus), "--set", "asgd_patience=1", "--set", "lr_decay_epochs=[1]"]
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert main(["train", "ptb-small", *ARGS, *tiny, "--epochs", then, "--out", str(straight), *SMOKE[2:]]) == 0
    assert main(["train", "ptb-small", *ARGS, *tiny, "--epochs", first, "--out", str(out), *SMOKE[2:]]) == 0
    assert timeless_summary(out)["epochs"] == pytest.approx(float(first), abs=0.05)
    assert main(["train", "ptb-small", *ARGS, *tiny, "--epochs", then, "--resume", "--out", str(out), *SMOKE[2:]]) == 0
    assert timeless_summary(straight)["steps"] >= 15  # epochs of several steps each
    assert_same_run(out, straight)


def test_a_run_with_a_round_in_flight_at_its_last_checkpoint_extends_to_the_straight_run(tmp_path, capsys):
    """Period 3, two fragments (offsets 0 and 1), overlap 2: fragment 1's round started after
    step 19 is in flight at the step-20 checkpoint; the extension lands it after step 21."""
    streaming = ["--fragments", "2", "--overlap", "2"]
    train(tmp_path / "straight", "--max-steps", "26", *streaming)
    out = tmp_path / "run"
    train(out, "--max-steps", "20", *streaming)
    train(out, "--max-steps", "26", "--resume", *streaming)
    assert_same_run(out, tmp_path / "straight")
    other = tmp_path / "other"
    train(other, "--max-steps", "20", *streaming)
    capsys.readouterr()
    assert main(["train", "ptb-small", *ARGS, "--max-steps", "26", "--resume", "--fragments", "1", "--overlap", "2",
                 "--out", str(other), *SMOKE]) != 0
    assert "fragments: 2 in the run, 1 now" in capsys.readouterr().err


@pytest.mark.full  # spawned processes
def test_streaming_rounds_under_spawn_equal_the_simulation(tmp_path):
    """Rounds in flight over gloo's non-blocking all-reduce, through the trainer (checkpoints
    taken with a round in flight included): the simulation's run, bit for bit."""
    streaming = ["--fragments", "2", "--overlap", "1", "--max-steps", "12"]
    train(tmp_path / "simulate", *streaming)
    train(tmp_path / "spawn", *streaming, "--runtime", "spawn", "--set", "threads=1")
    assert_same_run(tmp_path / "simulate", tmp_path / "spawn")


def test_a_rank_ahead_of_rank_0_keeps_its_file_of_the_next_checkpoint(tmp_path, monkeypatch):
    """Between rounds the workers do not wait for each other: past the barrier of the step-10
    checkpoint, rank 1 trains step 11 alone and writes its file of the step-11 checkpoint (the
    budget's end) while rank 0 may still be committing step-10. That commit must not take the
    newer, unfinished set for an abandoned one and delete it (the resumed sweep's flaky
    "checkpoint step-11 lacks the files of ranks [1]"). Rank 0 is held here until rank 1's file
    exists, so the interleaving that load made rare happens every time."""
    import time

    from localclip.train.run_folder import RunFolder

    commit = RunFolder.commit_checkpoint

    def late_commit(self, step, world_size, **kwargs):
        if step == 10:
            deadline = time.monotonic() + 60  # never wait forever, whatever the outcome
            while not self.checkpoint_file("step-11", 1).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert self.checkpoint_file("step-11", 1).exists(), "rank 1 never got ahead"
        return commit(self, step, world_size, **kwargs)

    monkeypatch.setattr(RunFolder, "commit_checkpoint", late_commit)
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--period", "4", "--set", "checkpoint_interval=2",
                 "--max-steps", "11", "--out", str(out), *SMOKE]) == 0
    index = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert [e["dir"] for e in index["checkpoints"]] == ["step-11", "step-10"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step-10", "step-11"]
