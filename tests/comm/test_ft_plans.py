"""The simulator's failure plan and the torchft runtime agree to the bit on a kill and restart
at round boundaries: ``localclip train --runtime simulate --fail 1@8:16`` against
``--runtime ft`` with 2 worker processes, worker 1 killed with SIGKILL at the start of the round
after its 8th step and restarted with ``--resume``, healing at the round at step 16.

The timing is made deterministic by hooks at a round's start (tests/comm/ft_cli_worker.py):
worker 1 kills itself there, before it asks for a quorum; worker 0 waits at the round after
step 16 until the test has seen the restarted worker 1 wait at the lighthouse for a quorum, so
that the quorum at step 16 is the first one with both (torchft's lighthouse forms it as soon as
the previous quorum's members, worker 0, have asked). Both first wait for each other before
their join round, so that the first quorum holds both. The test signals only its own
processes, by pid.

Both runs compute with one intra-op thread per worker (``threads=1``): the simulator splits the
machine's cores among its workers, a worker started by hand takes all of them, and a different
thread count adds some of a step's sums in another order, so a step's last bits differ.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMOKE_DATA, FtWorkers, wait_until

from localclip.comm import ft

pytestmark = [pytest.mark.full, pytest.mark.skipif(ft.available() is not None, reason=ft.available() or "")]

WORKER = Path(__file__).with_name("ft_cli_worker.py")
LIMIT = 3600  # seconds a wait may take: on a loaded machine a worker takes minutes to start and to reach step 8
LEAVE, REJOIN, STEPS = 8, 16, 24


def _args(out, runtime, extra=()):
    return ["train", "ptb-small", "--workers", "2", "--runtime", runtime, "--out", str(out), "--no-progress", *SMOKE_DATA,
            "--period", "4", "--max-steps", str(STEPS), "--set", "log_interval=4", "--set", "eval_tokens=1000",
            "--set", "model_options.dropout=0.2", "--set", "threads=1", *extra]


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _quorums(folder: Path) -> list[list[int]]:
    return [q for r in _records(folder) for q in r.get("comm/quorums", [])]


def test_a_kill_and_restart_at_round_boundaries_in_ft_equals_the_simulators_plan_to_the_bit(tmp_path):
    from localclip.cli import main

    sim = tmp_path / "sim"
    assert main(_args(sim, "simulate", ["--fail", f"1@{LEAVE}:{REJOIN}"])) == 0
    expected = json.loads((sim / "summary.json").read_text())["model/sha256"]

    out, gate = tmp_path / "ft", tmp_path / "gate"
    group = FtWorkers(tmp_path, 2, min_replicas=1, join_timeout=2.0, heartbeat_timeout=2.0)
    started = []

    def start(rank, hooks, extra=()):
        env = {**group.env, "TORCHFT_LIGHTHOUSE": group.lighthouse.address(), "LOCALCLIP_REPLICA": str(rank)}
        with open(tmp_path / f"cli{rank}-{len(started)}.txt", "w") as err:
            proc = subprocess.Popen([sys.executable, str(WORKER), *hooks, "--", *_args(out, "ft", extra)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)
        started.append(proc)
        return proc

    def stderr():
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("cli*.txt")))

    try:
        begin = tmp_path / "start-gate"
        survivor = start(0, ["--hold-at", str(REJOIN), "--gate", str(gate), "--start-gate", str(begin)])
        leaver = start(1, ["--exit-at", str(LEAVE), "--start-gate", str(begin)])
        wait_until(lambda: all(Path(f"{begin}.{r}").exists() or p.poll() is not None for r, p in enumerate((survivor, leaver))),
                   "both workers to start", LIMIT)
        begin.touch()
        assert leaver.wait(timeout=LIMIT) == -signal.SIGKILL, stderr()
        wait_until(lambda: Path(f"{gate}.held").exists() or survivor.poll() is not None, "worker 0 to reach the round at step 16", LIMIT)
        assert survivor.poll() is None, stderr()
        rejoined = start(1, [], ["--resume"])
        wait_until(lambda: group.waiting() >= 1 or rejoined.poll() is not None, "the restarted worker to ask for a quorum", LIMIT)
        gate.touch()
        for proc in (survivor, rejoined):
            assert proc.wait(timeout=LIMIT) == 0, stderr()
    finally:
        for proc in started:  # only what this test started, by pid
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        group.close()

    # The same rounds: [step, quorum, models averaged].
    plan = [q for r in _records(sim) for q in r.get("comm/quorums", [])]
    assert plan == [[4, 2, 2], [8, 1, 1], [12, 1, 1], [16, 2, 1], [20, 2, 2], [24, 2, 2]]
    assert _quorums(out / "replica-0") == plan
    assert [q for q in _quorums(out / "replica-1") if q[0] >= REJOIN] == plan[3:]
    for rank in range(2):
        assert json.loads((out / f"replica-{rank}" / "summary.json").read_text())["model/sha256"] == expected
