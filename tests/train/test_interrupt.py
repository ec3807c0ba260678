"""SIGTERM/SIGINT: every worker finishes its step, the workers agree on the stop step, checkpoint
and exit with status 75 ("interrupted, resumable"); --resume then equals the uninterrupted run.
A second signal exits at once and leaves the last complete checkpoint intact."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from localclip import interrupt
from localclip.cli import main
from localclip.errors import Interrupted

from helpers import SHARED, SMOKE, assert_same_run


PERIOD = 3
ARGS = ["--workers", "2", "--period", str(PERIOD), "--max-steps", "60", "--set", "checkpoint_interval=50", "--set", "threads=1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = Path(sys.executable).with_name("torchrun")


def start(out: Path, *extra: str, launcher: list[str] | None = None) -> subprocess.Popen:
    cmd = [*(launcher or [sys.executable, "-m", "localclip.cli"]), "train", "ptb-small", *ARGS, *extra, "--out", str(out), *SMOKE]
    # A session of its own, so that a signal to the group reaches this run's processes only.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step} (exit status {proc.poll()}): {proc.stderr.read() if proc.poll() is not None else ''}")


def signal_at_step(proc, out: Path, step: int, send, timeout: float = 180) -> str:
    """Once ``proc`` has logged ``step``, ``send(proc)``; wait for it to exit; return its stderr
    (the process group is killed if it is still there)."""
    try:
        wait_for_step(proc, out, step)
        send(proc)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return err


def interrupt_at_random_step(out: Path, send, *extra: str, launcher=None) -> tuple[int, str, int]:
    """Start a run, signal it once a random logged step is reached; return (status, stderr, stop step)."""
    seed = random.randrange(10**6)
    at = random.Random(seed).choice(range(3, 31, 3))  # the steps that log a record
    proc = start(out, *extra, launcher=launcher)
    err = signal_at_step(proc, out, at, send)
    found = re.search(r"interrupted by SIG\w+ at step (\d+)", err)
    assert found, f"seed {seed}, signal after step {at}: {err[-3000:]}"
    stop = int(found.group(1))
    assert at <= stop < 60 and stop % PERIOD == 0, f"seed {seed}: asked after step {at}, stopped at {stop}"
    assert "resumable: run the same command with --resume" in err
    assert not (out / "summary.json").exists()
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == stop
    return proc.returncode, err, stop


def train(out: Path, *extra: str) -> None:
    assert main(["train", "ptb-small", *ARGS, *extra, "--out", str(out), *SMOKE]) == 0


def test_sigterm_under_simulate_checkpoints_and_resumes_bit_identically(tmp_path):
    code, err, _ = interrupt_at_random_step(tmp_path / "run", lambda p: p.send_signal(signal.SIGTERM))
    assert code == Interrupted.exit_code == 75, err
    assert err.count("SIGTERM received") == 1
    train(tmp_path / "run", "--resume")
    train(tmp_path / "straight")
    assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.mark.full  # spawned processes
def test_ctrl_c_under_spawn_checkpoints_and_resumes_bit_identically(tmp_path):
    """Ctrl-C reaches the parent and both workers, and the parent passes it on too: one stop."""
    spawn = ("--runtime", "spawn")
    code, err, _ = interrupt_at_random_step(tmp_path / "run", lambda p: os.killpg(p.pid, signal.SIGINT), *spawn)
    assert code == 75, err
    assert err.count("SIGINT received") == 1 and "exiting at once" not in err
    train(tmp_path / "run", "--resume", *spawn)
    train(tmp_path / "straight", *spawn)
    assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.mark.full  # spawned processes
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to this Python")
def test_sigterm_to_torchrun_checkpoints_and_resumes_bit_identically(tmp_path):
    """The scheduler signals the torchrun agent; it passes SIGTERM on to the workers."""
    launcher = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "localclip.cli"]
    tr = ("--runtime", "torchrun")
    code, err, _ = interrupt_at_random_step(tmp_path / "run", lambda p: p.send_signal(signal.SIGTERM), *tr, launcher=launcher)
    assert code != 0, err
    assert err.count("interrupted by SIGTERM") == 1  # rank 0 says it, once
    resumed = subprocess.run([*launcher, "train", "ptb-small", *ARGS, *tr, "--resume", "--out", str(tmp_path / "run"), *SMOKE],
                             capture_output=True, text=True, timeout=240, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Two gloo processes sum in the same order under torchrun and spawn: the straight run is a spawned one.
    train(tmp_path / "straight", "--runtime", "spawn")
    assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.mark.full  # signals to a training process
def test_a_second_signal_exits_at_once_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    # A long period: the first signal's agreement point is far away when the second one comes.
    proc = start(out, "--period", "300", "--max-steps", "600", "--set", "checkpoint_interval=4", "--set", "stop_check_interval=0")
    try:
        wait_for_step(proc, out, 4)
        while not (out / "checkpoints" / "latest.json").exists():
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(interrupt.REPEAT_WINDOW + 0.5)
        assert proc.poll() is None, "the first signal alone stopped the run"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "second SIGTERM: exiting at once" in err and "interrupted by" not in err
    assert took < 10
    index = json.loads((out / "checkpoints" / "latest.json").read_text())
    for entry in index["checkpoints"]:  # every set the index names is complete and readable
        for rank in (0, 1):
            torch.load(out / "checkpoints" / entry["dir"] / f"rank-{rank}.pt", weights_only=True)
    newest = index["step"]
    assert main(["train", "ptb-small", *ARGS, "--period", "300", "--max-steps", str(newest + 2), "--set", "checkpoint_interval=4",
                 "--set", "stop_check_interval=0", "--resume", "--out", str(out), *SMOKE]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == newest + 2


@pytest.mark.full  # signals to a training process
def test_a_long_period_stops_at_the_next_stop_check_not_the_next_round(tmp_path):
    """I = 300: the workers check for a stop request every stop_check_interval = 8 steps, so a
    sweep's grace time is not spent waiting for a round that is minutes away."""
    out = tmp_path / "run"
    proc = start(out, "--period", "300", "--max-steps", "600", "--set", "stop_check_interval=8")
    err = signal_at_step(proc, out, 9, lambda p: p.send_signal(signal.SIGTERM), timeout=120)
    assert proc.returncode == 75, err
    stop = int(re.search(r"interrupted by SIGTERM at step (\d+)", err).group(1))
    assert stop % 8 == 0 and 9 < stop < 300, stop
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == stop


def test_one_signal_delivered_twice_counts_once():
    """Ctrl-C reaches a worker from the terminal and again from its launcher: one request."""
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.catch(announce=False):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one this soon would otherwise exit at once
        time.sleep(0.05)
        assert interrupt.requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before and interrupt.requested() == 0


@pytest.mark.full  # signals to a training process
def test_the_stop_messages_get_lines_of_their_own_beside_the_progress_bar(tmp_path):
    """With the bar on stderr, Ctrl-C's announcement starts a line (not the bar's), and the final
    message follows the erased bar without a rank prefix: every worker stopped at the same step."""
    out = tmp_path / "run"
    with_bar = [arg for arg in SMOKE if arg != "--no-progress"]
    cmd = [sys.executable, "-m", "localclip.cli", "train", "ptb-small", *ARGS, "--out", str(out), *with_bar]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    err = signal_at_step(proc, out, 3, lambda p: p.send_signal(signal.SIGINT))
    assert proc.returncode == 75, err
    assert "%|" in err  # the bar was drawn
    lines = err.split("\n")
    assert sum(line.startswith("localclip: SIGINT received") for line in lines) == 1, err
    shown = [line.rsplit("\r", 1)[-1] for line in lines]  # what a terminal shows after the bar's carriage returns
    assert sum(line.startswith("localclip: interrupted by SIGINT at step") for line in shown) == 1, err
    assert "rank 0" not in err
