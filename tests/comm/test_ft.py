"""Fault-tolerant rounds over torchft (localclip.comm.ft): 3 worker processes on gloo, one killed
with SIGKILL in the middle of a period (the others finish, identical after every committed
round, each round's quorum recorded), then restarted (it heals from a live peer and all three
finish identical; no round averages its zeros), and an unreachable lighthouse (one line).

Workers are tests/ft_worker.py processes; a test kills only the processes it started, by pid.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from localclip.comm import ft

pytestmark = pytest.mark.skipif(ft.available() is not None, reason=ft.available() or "")

WORKER = Path(__file__).with_name("ft_worker.py")
SRC = str(Path(ft.__file__).resolve().parents[2])
LIMIT = 900  # seconds a worker may take to get somewhere: a loaded machine takes minutes to start one


@pytest.fixture
def run(tmp_path):
    # A join timeout far above any stall of a live worker on a loaded machine: a quorum leaves
    # out only a worker that is gone (its heartbeats stopped for 2 s), never a slow one.
    lighthouse = ft.start_lighthouse(min_replicas=2, join_timeout=600.0, heartbeat_timeout=2.0)
    started: list[subprocess.Popen] = []

    def start(rank, *, steps, sleep, address=None, timeout=30.0, hold_at=0, die_in_round=0, start_gate=None):
        with open(tmp_path / f"stderr{rank}-{len(started)}.txt", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--rank", str(rank), "--world", "3", "--lighthouse", address or lighthouse.address(),
                 "--out", str(tmp_path), "--steps", str(steps), "--sleep", str(sleep), "--timeout", str(timeout),
                 "--hold-at", str(hold_at), "--gate", str(tmp_path / "gate"), "--die-in-round", str(die_in_round),
                 "--start-gate", str(start_gate or "")],
                env={**os.environ, "PYTHONPATH": SRC}, stdout=subprocess.DEVNULL, stderr=err,
            )
        started.append(proc)
        return proc

    def together(*, steps, sleep, **per_rank):
        """All three workers, asking for their first quorum only once every one of them is up
        (a loaded machine may take minutes to start one), so that the first quorum holds all
        three. ``per_rank``: an option's value for each rank (a list of three)."""
        gate = tmp_path / "start-gate"
        procs = [start(r, steps=steps, sleep=sleep, start_gate=gate, **{k: v[r] for k, v in per_rank.items()}) for r in range(3)]
        _wait(lambda: all(any("started" in x for x in _records(tmp_path, r)) or procs[r].poll() is not None for r in range(3)),
              "every worker to start")
        gate.touch()
        return procs

    start.out, start.together = tmp_path, together
    yield start
    for proc in started:  # only what this test started, by pid
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    lighthouse.shutdown()


def _records(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, what: str, limit: float = LIMIT) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _last_step(out, rank) -> int:
    return max((r["step"] for r in _records(out, rank) if "step" in r), default=0)


def _rounds(out, rank) -> dict[int, dict]:
    return {r["step"]: r for r in _records(out, rank) if "quorum" in r}


def _kill_mid_period(run, rank, step):
    """SIGKILL worker ``rank`` once it has logged ``step`` (not a multiple of the period)."""
    _wait(lambda: _last_step(run.out, rank) >= step, f"rank {rank} to reach step {step}")
    os.kill(run.procs[rank].pid, signal.SIGKILL)
    run.procs[rank].wait()


def _finish(proc):
    assert proc.wait(timeout=LIMIT) == 0


def test_kill_one_of_three_mid_period_the_others_finish_identical(run):
    steps = 40
    # Worker 2 stops before its step 11 (its gate never opens): it is killed between its steps
    # 10 and 11 however late this test sees its step 10, never after it reached round 12.
    run.procs = run.together(steps=steps, sleep=0.1, hold_at=[0, 0, 11])
    _kill_mid_period(run, 2, 10)
    for r in (0, 1):
        _finish(run.procs[r])
    live = [_rounds(run.out, r) for r in (0, 1)]
    for r in (0, 1):
        assert [x["step"] for x in _records(run.out, r) if "step" in x] == list(range(1, steps + 1))  # every step
        assert _records(run.out, r)[-1]["done"] == steps
    assert sorted(live[0]) == sorted(live[1]) == list(range(4, steps + 1, 4))
    quorums = [(s, live[0][s]["quorum"], live[0][s]["averaged"]) for s in sorted(live[0])]
    assert quorums == [(s, live[1][s]["quorum"], live[1][s]["averaged"]) for s in sorted(live[1])]
    assert [q for _, q, _ in quorums[:2]] == [3, 3]  # rounds at steps 4 and 8: everyone
    assert [q for s, q, _ in quorums if s >= 12] == [2] * len(quorums[2:])  # after the kill: the two survivors
    for s, quorum, averaged in quorums:
        if averaged == 0:
            continue  # discarded: nothing to compare
        assert live[0][s]["post"] == live[1][s]["post"]  # identical after each committed round
        if quorum == 2:
            mean = (torch.tensor(live[0][s]["pre"]) + torch.tensor(live[1][s]["pre"])) / 2
            torch.testing.assert_close(torch.tensor(live[0][s]["post"]), mean, rtol=0, atol=1e-6)


def test_a_restarted_worker_heals_from_a_live_peer_and_no_round_averages_its_zeros(run):
    steps = 40
    # The survivors wait before step 22 until the restarted worker has started (a loaded machine
    # may take longer to start a process than the survivors take to finish).
    run.procs = run.together(steps=steps, sleep=0.1, hold_at=[22, 22, 11])
    _kill_mid_period(run, 2, 10)
    # Restart it once the survivors have committed a round without it.
    _wait(lambda: any(x["quorum"] == 2 for x in _rounds(run.out, 0).values()), "a round of the two survivors")
    run.procs[2] = run(2, steps=steps, sleep=0.1)
    _wait(lambda: sum("started" in r for r in _records(run.out, 2)) == 2, "the restarted worker to start")
    (run.out / "gate").touch()
    for proc in run.procs:
        _finish(proc)
    joins = [r for r in _records(run.out, 2) if "joined" in r]
    assert len(joins) == 2 and not joins[0]["healed"] and joins[1]["healed"]
    heal_step = joins[1]["joined"]  # the round it healed at: its peer's step count
    assert heal_step % 4 == 0 and heal_step > 10
    live = [_rounds(run.out, r) for r in range(3)]
    heal = live[0][heal_step]
    assert (heal["quorum"], heal["averaged"]) == (3, 2)  # in the quorum, its model not averaged
    pre = [torch.tensor(live[r][heal_step]["pre"]) for r in (0, 1)]
    post = torch.tensor(heal["post"])
    torch.testing.assert_close(post, (pre[0] + pre[1]) / 2, rtol=0, atol=1e-6)
    assert not torch.allclose(post, (pre[0] + pre[1]) / 3, atol=1e-3)  # zeros from the joiner would do this
    # After the heal, every committed round leaves all three identical, to the end.
    after = [s for s in sorted(live[2]) if s > heal_step]
    assert after and after[-1] == steps
    for s in after:
        assert live[0][s]["quorum"] == 3
        if live[0][s]["averaged"]:
            assert live[0][s]["post"] == live[1][s]["post"] == live[2][s]["post"]
    assert _records(run.out, 2)[-1]["done"] == steps


def test_a_worker_killed_during_a_rounds_transport_the_round_is_discarded(run):
    steps = 20
    run.procs = run.together(steps=steps, sleep=0.05, timeout=[10.0] * 3, die_in_round=[0, 0, 8])
    assert run.procs[2].wait(timeout=LIMIT) == -signal.SIGKILL
    for r in (0, 1):
        _finish(run.procs[r])
    live = [_rounds(run.out, r) for r in (0, 1)]
    for r in (0, 1):
        assert (live[r][8]["quorum"], live[r][8]["averaged"]) == (3, 0)  # discarded
        assert live[r][8]["post"] == live[r][8]["pre"]  # each kept its pre-round state
        assert _records(run.out, r)[-1]["discarded"] == 1
    assert live[0][8]["post"] != live[1][8]["post"]  # their own local models, not an average
    for s in (12, 16, 20):
        assert (live[0][s]["quorum"], live[0][s]["averaged"]) == (2, 2)
        assert live[0][s]["post"] == live[1][s]["post"]


def test_an_unreachable_lighthouse_is_one_line(run):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("localhost", 0))
        address = f"http://localhost:{s.getsockname()[1]}"
    proc = run(0, steps=4, sleep=0.0, address=address, timeout=3.0)
    assert proc.wait(timeout=LIMIT) == 3
    err = next(run.out.glob("stderr0-*.txt")).read_text().strip().splitlines()
    lines = [line for line in err if line.startswith("error:")]
    assert len(lines) == 1 and "lighthouse" in lines[0] and address in lines[0]


# -- localclip train --runtime ft ---------------------------------------------------------------

def _cli_run(tmp_path, name, runtime, workers, extra=()):
    from localclip.cli import main
    from helpers import SMOKE_DATA

    out = tmp_path / name
    args = ["train", "ptb-small", "--workers", str(workers), "--runtime", runtime, "--out", str(out), "--no-progress", *SMOKE_DATA,
            "--period", "4", "--max-steps", "12", "--set", "log_interval=4", "--set", "eval_tokens=1000", "--set", "model_options.dropout=0.2", *extra]
    return main(args), out


def test_runtime_ft_equals_the_simulator_to_the_bit_with_two_workers(tmp_path):
    code, sim = _cli_run(tmp_path, "sim", "simulate", 2)
    assert code == 0
    code, ft_out = _cli_run(tmp_path, "ft", "ft", 2)
    assert code == 0
    expected = [(r["step"], r.get("train/loss"), r.get("val/ppl")) for r in map(json.loads, (sim / "metrics.jsonl").read_text().splitlines())]
    sha = json.loads((sim / "summary.json").read_text())["model/sha256"]
    for rank in range(2):
        folder = ft_out / f"replica-{rank}"
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        # The same models: a worker of a fault-tolerant run evaluates every column itself, the
        # simulated ones half each, so the perplexities agree to rounding, the models to the bit.
        assert [r["step"] for r in records if "val/ppl" in r] == [s for s, _, v in expected if v is not None]
        assert [r["val/ppl"] for r in records if "val/ppl" in r] == pytest.approx([v for _, _, v in expected if v is not None], rel=1e-5)
        assert [q for r in records for q in r.get("comm/quorums", [])] == [[4, 2, 2], [8, 2, 2], [12, 2, 2]]
        assert json.loads((folder / "summary.json").read_text())["model/sha256"] == sha


@pytest.mark.parametrize("extra, message", [
    (["--fragments", "2"], "Invalid fragments"),
    (["--compression", "int4"], "Invalid compression"),
    (["--algorithm", "episode"], "Invalid algorithm"),
])
def test_runtime_ft_refuses_what_a_changing_group_cannot_run_in_one_line(tmp_path, capsys, extra, message):
    code, out = _cli_run(tmp_path, "run", "ft", 3, extra)
    err = capsys.readouterr().err
    assert code != 0 and message in err and "--runtime ft" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
