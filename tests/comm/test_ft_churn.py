"""Fault-tolerant rounds under churn (localclip.comm.ft, 3 tests/comm/ft_worker.py processes on
gloo): a worker frozen with SIGSTOP (the others go on after the quorum timeout; after SIGCONT
it heals and all three finish identical), and a chaos run (one worker killed with SIGKILL at
random about every 50 steps and restarted each time: the run completes, the workers that lived
never lose a committed round, all end identical).

Every wait is for an event the workers record (a step, a round, a heal), not for a time; its
limit is derived from the step time measured in the same run, with a floor for a loaded
machine (where starting a Python process with torch takes tens of seconds). A test signals
only the processes it started, by pid (helpers.FtWorkers).
"""

import os
import random
import signal

import pytest
import torch
from helpers import FtWorkers, wait_until

from localclip.comm import ft

pytestmark = [pytest.mark.full, pytest.mark.skipif(ft.available() is not None, reason=ft.available() or "")]

PERIOD = 4
FLOOR = 600  # seconds: the least any wait may take before it fails (a loaded machine starts a worker in minutes)
HEARTBEAT = 2.0  # the lighthouse's heartbeat timeout, seconds


@pytest.fixture
def workers(tmp_path):
    # A join timeout far above any stall of a live worker: only a frozen one, whose heartbeats
    # stop for 2 s, is left out of a round.
    group = FtWorkers(tmp_path, 3, min_replicas=2, join_timeout=60.0, heartbeat_timeout=HEARTBEAT)
    yield group
    group.close()


def _steps(records) -> list[int]:
    return [r["step"] for r in records if "step" in r]


def _rounds(records) -> dict[int, dict]:
    """The rounds a worker took part in, by the round's step (a heal moves a worker to its peer's)."""
    return {r["round"]: r for r in records if "round" in r}


def _step_time(records) -> float:
    """The median seconds between two consecutive steps of one worker, measured."""
    t = [r["t"] for r in records if "t" in r]
    gaps = sorted(b - a for a, b in zip(t, t[1:]))
    return gaps[len(gaps) // 2] if gaps else 1.0


def _limit(workers, rank, steps) -> float:
    """How long ``steps`` steps of worker ``rank`` may take: 20x their measured time, rounds'
    timeouts included, never under FLOOR."""
    return max(FLOOR, 20 * (steps * _step_time(workers.records(rank)) + 2 * HEARTBEAT))


def _finish(workers, proc, limit=FLOOR):
    code = proc.wait(timeout=limit)
    assert code == 0, workers.stderr()


def test_a_frozen_worker_is_left_out_after_the_quorum_timeout_and_heals_after_sigcont(workers):
    steps, freeze_at, hold_at = 48, 10, 33
    # The two others wait before step 33 until the test opens the gate: the frozen worker then
    # rejoins at their next round, whatever the load (it has asked for a quorum by then).
    procs = workers.start_together(steps=steps, sleep=0.1, hold_at=hold_at, gate=workers.out / "gate")
    wait_until(lambda: max(_steps(workers.records(2)), default=0) >= freeze_at, "worker 2 to reach step 10", FLOOR)
    workers.signal(procs[2], signal.SIGSTOP)  # in the middle of a period (rounds at multiples of 4)
    frozen_at = max(_steps(workers.records(2)))
    limit = _limit(workers, 0, hold_at)
    wait_until(lambda: min(max(_steps(workers.records(r)), default=0) for r in (0, 1)) >= hold_at - 1, "the others to reach the gate", limit)
    workers.signal(procs[2], signal.SIGCONT)
    wait_until(lambda: workers.waiting() >= 1, "the woken worker to ask for a quorum", limit)
    (workers.out / "gate").touch()
    for proc in procs:
        _finish(workers, proc, limit)

    records = [workers.records(r) for r in range(3)]
    live = [_rounds(records[r]) for r in range(3)]
    for r in (0, 1):  # the two others: every step, every round, never held up for long
        assert _steps(records[r]) == list(range(1, steps + 1))
        assert sorted(live[r]) == list(range(PERIOD, steps + 1, PERIOD))
        assert records[r][-1]["done"] == steps
    first_without = frozen_at - frozen_at % PERIOD + PERIOD  # its next round after the freeze
    for s in sorted(live[0]):
        a, b = live[0][s], live[1][s]
        assert (a["quorum"], a["averaged"], a["committed"]) == (b["quorum"], b["averaged"], b["committed"])
        if s < first_without:
            assert (a["quorum"], a["averaged"]) == (3, 3)
        elif s == first_without and a["averaged"] == 0:
            assert a["post"] == a["pre"] and b["post"] == b["pre"]  # frozen inside that round: discarded
        elif s < hold_at:  # the quorum timeout passed without it: the two others' rounds
            assert (a["quorum"], a["averaged"]) == (2, 2)
            assert a["post"] == b["post"]
            mean = (torch.tensor(a["pre"]) + torch.tensor(b["pre"])) / 2
            torch.testing.assert_close(torch.tensor(a["post"]), mean, rtol=0, atol=1e-6)
    assert sum(live[0][s]["quorum"] == 2 for s in live[0]) >= 4
    # After SIGCONT it heals at the others' first round (step 36): in the quorum, not averaged.
    heal = hold_at - hold_at % PERIOD + PERIOD
    assert sorted(s for s in live[2] if s > frozen_at) == list(range(heal, steps + 1, PERIOD))
    assert (live[0][heal]["quorum"], live[0][heal]["averaged"]) == (3, 2)
    assert live[2][heal]["post"] == live[0][heal]["post"] == live[1][heal]["post"]
    pre = [torch.tensor(live[r][heal]["pre"]) for r in (0, 1)]
    torch.testing.assert_close(torch.tensor(live[0][heal]["post"]), (pre[0] + pre[1]) / 2, rtol=0, atol=1e-6)
    assert _steps(records[2])[-(steps - heal):] == list(range(heal + 1, steps + 1))  # its steps move to the others'
    for s in range(heal + PERIOD, steps + 1, PERIOD):  # all three, identical, to the end
        assert [(live[r][s]["quorum"], live[r][s]["averaged"]) for r in range(3)] == [(3, 3)] * 3
        assert live[0][s]["post"] == live[1][s]["post"] == live[2][s]["post"]
        assert live[0][s]["committed"] == live[1][s]["committed"] == live[2][s]["committed"]
    assert records[2][-1]["done"] == steps


def _lives(records) -> list[list[dict]]:
    """A worker's records split by process (a restart appends to the same file)."""
    lives = []
    for r in records:
        if "started" in r:
            lives.append([])
        if lives:
            lives[-1].append(r)
    return lives


def _healed(records, pid: int) -> bool:
    """Whether process ``pid`` of a worker has healed from a live peer (its join round)."""
    return any(life[0]["pid"] == pid and any(r.get("healed") for r in life) for life in _lives(records))


def test_chaos_one_of_three_killed_about_every_50_steps_and_restarted_the_run_completes(tmp_path):
    steps, seed = 600, 2026
    chance = random.Random(seed)
    plan, at = [], 0  # (step, rank): kill worker rank once the run has reached step
    while True:
        at += chance.randint(30, 70)
        if at > steps - 4 * PERIOD:
            break
        plan.append((at, chance.randrange(3)))
    # The workers may run 2 periods past the next kill's step and no further (the file
    # ``limit``): a restarted worker takes seconds to start (minutes on a loaded machine), and
    # the others must still be there when it asks to join. While they wait at the limit it
    # waits at the lighthouse; then the limit moves on and it heals at their next round.
    limit = tmp_path / "limit"

    def allow(step):
        (tmp_path / "limit.tmp").write_text(str(step))
        os.replace(tmp_path / "limit.tmp", limit)

    # A join timeout far above any stall of a live worker: only a dead one, whose heartbeats
    # stop for 2 s, is left out of a round.
    workers = FtWorkers(tmp_path, 3, min_replicas=2, join_timeout=60.0, heartbeat_timeout=HEARTBEAT)
    try:
        options = dict(steps=steps, sleep=0.05, timeout=30.0, limit=limit)
        allow(plan[0][0] + 2 * PERIOD)
        procs = workers.start_together(**options)
        last = lambda r: max(_steps(workers.records(r)), default=0)  # noqa: E731
        killed = []
        for n, (at, rank) in enumerate(plan):
            allow(at + 2 * PERIOD)
            wait_until(lambda: max(last(r) for r in range(3)) >= at, f"the run to reach step {at}", _limit(workers, rank, at))
            workers.signal(procs[rank], signal.SIGKILL)
            procs[rank].wait()
            killed.append((last(rank), rank))
            procs[rank] = workers.start(rank, **options)
            others = [r for r in range(3) if r != rank]
            pid = procs[rank].pid
            wait_until(lambda: _healed(workers.records(rank), pid) or (all(last(r) >= at + 2 * PERIOD for r in others) and workers.waiting() >= 1),
                       f"restarted worker {rank} to heal or ask to", 3 * FLOOR)
            allow(plan[n + 1][0] + 2 * PERIOD if n + 1 < len(plan) else steps)
            wait_until(lambda: _healed(workers.records(rank), pid), f"restarted worker {rank} to heal", 3 * FLOOR)
        allow(steps)
        for proc in procs:
            _finish(workers, proc)
        records = [workers.records(r) for r in range(3)]
    finally:
        workers.close()

    assert len(killed) == len(plan) >= 8
    by_round: dict[int, list[dict]] = {}
    for rank in range(3):
        lives = _lives(records[rank])
        assert len(lives) == 1 + sum(r == rank for _, r in plan)
        for n, life in enumerate(lives):
            steps_of = _steps(life) or [0]
            # Every process computes consecutive steps: after a kill the others go on without a
            # step lost or repeated, and a restarted one starts where its peers were.
            assert steps_of == list(range(steps_of[0], steps_of[0] + len(steps_of))), (rank, n)
            join = next(r for r in life if "joined" in r)
            assert join["healed"] == (n > 0)  # a restarted process heals from a live peer
            if n > 0 and len(steps_of) > 1:
                assert steps_of[0] == join["joined"] + 1
            rounds = [r for r in life if "round" in r]
            committed = [r["committed"] for r in rounds if r["averaged"]]
            assert committed == sorted(set(committed))  # never back: no committed round is lost
            for r in rounds:
                by_round.setdefault(r["round"], []).append(r)
        assert lives[-1][-1]["done"] == steps
    for s, seen in by_round.items():  # whoever committed a round holds the same model after it
        committed = [r for r in seen if r["averaged"]]
        assert all(r["post"] == committed[0]["post"] for r in committed), s
        assert len({r["committed"] for r in committed}) <= 1, s
    final = by_round[steps]
    assert len(final) == 3 and all(r["quorum"] == 3 and r["post"] == final[0]["post"] for r in final)
    # Whether the others run rounds of two before the restarted worker heals depends on how fast
    # it restarts (one run on a nearly idle machine recorded no round of two in 11 kills), so it is not
    # asserted here;
    # rounds without a departed worker are asserted by test_ft.py's kill test and the SIGSTOP test.
