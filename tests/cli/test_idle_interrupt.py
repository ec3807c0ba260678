"""Ctrl-C on a thousand-worker run (8 sampled a round, the others idle), as a user types it: the
command stops within a few steps, says so in one line, exits 75 and leaves a run that
``--resume`` continues."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from helpers import SMOKE

PERIOD = 4
ARGS = ["ptb-small", "--workers", "1000", "--set", "participants=8", "--set", "non_participants=idle", "--period", str(PERIOD),
        "--set", "checkpoint_interval=1000", "--set", "threads=1", *SMOKE]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Ctrl-C stops the run at the next round, at most PERIOD steps of the 8 slots later, and then 8
# checkpoint files are written. What that costs is bounded in CPU seconds of the run's process
# (all its threads), which a loaded machine does not stretch as it stretches the wall time:
# 1.61 CPU s (29.7 s of wall time at load 29 on 2 cores) when it was written.
STOP_CPU_S = 10


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process, all its threads (Linux's /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def logged_steps(out) -> list[int]:
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}") and '"step"' in line]


@pytest.mark.full  # a training process and its resume
def test_ctrl_c_stops_a_thousand_worker_run_quickly_and_resume_continues_it(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "localclip.cli", "train", *ARGS, "--max-steps", "400", "--out", str(out)]
    # A session of its own: the SIGINT to its group reaches this run's process only, as a
    # terminal's Ctrl-C reaches its foreground job.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not logged_steps(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert logged_steps(out), f"no step logged (exit status {proc.poll()})"
        asked_at = max(logged_steps(out))
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_before = cpu_seconds(proc.pid)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - sent
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_total = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stop_cpu = cpu_total - cpu_before
    print(f"Ctrl-C after step {asked_at}: exited {proc.returncode} {took:.2f} s later, {stop_cpu:.2f} CPU s after the signal (load {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and "SIGINT received" not in line]
    assert len(lines) == 1 and "interrupted by SIGINT" in lines[0] and "--resume" in lines[0], err[-3000:]
    stop = int(re.search(r"at step (\d+)", lines[0]).group(1))
    # The next round after the signal (a record reaches metrics.jsonl a little after its step).
    assert asked_at <= stop <= asked_at + 2 * PERIOD and stop % PERIOD == 0, (asked_at, stop)
    assert stop_cpu < STOP_CPU_S, (stop_cpu, took)
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == stop
    assert not (out / "summary.json").exists()

    resumed = subprocess.run([sys.executable, "-m", "localclip.cli", "train", *ARGS, "--max-steps", str(stop + PERIOD), "--resume", "--out", str(out)],
                             capture_output=True, text=True, timeout=900, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == stop + PERIOD and summary["workers"] == 1000
