"""Surviving a killed worker under torchrun: the group restarts and resumes by itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localclip.cli import main

from helpers import SHARED, SMOKE

pytestmark = pytest.mark.full  # torchrun restarting a killed group


def worker_pids(parent: int) -> list[int]:
    """Child processes of ``parent`` running the localclip CLI, ordered by LOCAL_RANK."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"localclip" in cmdline:
            rank = next((int(e.split(b"=")[1]) for e in environ if e.startswith(b"LOCAL_RANK=")), -1)
            found.append((rank, int(entry.name)))
    return [pid for _, pid in sorted(found)]


def test_kill_9_of_a_worker_under_torchrun_resumes_and_matches_an_uninterrupted_run(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this Python")
    # One thread everywhere, so the simulated and the torchrun workers run the same kernels.
    # A short collective timeout: a restarted group that fails to connect gives up quickly and
    # torchrun tries again, instead of waiting out the default 300 s.
    args = ["--workers", "2", "--period", "3", "--max-steps", "40", "--set", "checkpoint_interval=5", "--set", "threads=1", "--set", "timeout=20"]
    assert main(["train", "ptb-small", *args, "--out", str(tmp_path / "straight"), *SMOKE]) == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())

    out = tmp_path / "elastic"
    # One restart is what the kill needs; two spares, because a restarted gloo group sometimes
    # fails its first connect here ("Gloo connectFullMesh failed ... Connection refused").
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "-m", "localclip.cli",
           "train", "ptb-small", "--runtime", "torchrun", "--resume", *args, "--out", str(out), *SMOKE]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        latest = out / "checkpoints" / "latest.json"
        while not latest.exists() and proc.poll() is None and time.monotonic() - start < 150:
            time.sleep(0.05)
        pids = worker_pids(proc.pid)
        assert pids and proc.poll() is None, "no worker to kill"
        killed_at = json.loads(latest.read_text())["step"]
        os.kill(pids[-1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert killed_at < 40
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == 40
    # gloo sums in another order than the simulation: equal up to float rounding.
    assert resumed["val/ppl"] == pytest.approx(straight["val/ppl"], rel=1e-5)
    assert resumed["comm/rounds"] == straight["comm/rounds"] and resumed["comm/bytes"] == straight["comm/bytes"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps), "metrics after the restart continue the truncated log"
