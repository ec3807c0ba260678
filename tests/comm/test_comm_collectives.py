"""all_to_all, all_gather and the non-blocking collectives: simulated workers (concurrent and
turn-taking) and gloo processes give the same bits, sums are in rank order, a worker computes
while its collectives travel, a missing peer times out naming the rank, and a world of one."""

import time

import pytest
import torch

from localclip.comm import Pending, SimulatedWorld, SingleProcess, current
from localclip.errors import CommunicationError
from localclip.comm.launch import spawn

from workers import completes_while_computing, interleaved_collectives, stall_nonblocking

JOIN = 120  # seconds: a hang fails the test instead of blocking CI


def _same_bits(a, b):
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _check(results, world):
    assert len(results) == world
    for rank, (got, expected) in enumerate(results):
        for key in expected:
            assert _same_bits(got[key], expected[key]), (rank, key)


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("world", [2, 3])
def test_interleaved_collectives_simulated_and_gloo_give_the_same_bits(world):
    """Three workers take gloo's rank-ordered sum with a helper thread for the all-gather phase,
    while the caller issues a blocking all-reduce and all-to-all in between: every result equals
    the rank-order sum recomputed from all inputs, in both runtimes and in both simulated modes."""
    real = spawn(interleaved_collectives, world, join_timeout=JOIN, timeout=30)
    sim = SimulatedWorld(world).run(interleaved_collectives)
    turns = SimulatedWorld(world, concurrent=False).run(interleaved_collectives)
    for results in (real, sim, turns):
        _check(results, world)
    for s, t, r in zip(sim, turns, real):
        assert _same_bits(s[0], r[0]) and _same_bits(t[0], r[0])


def test_more_simulated_workers_and_waits_in_any_order():
    for world in (4, 5):
        _check(SimulatedWorld(world, max_running=2).run(interleaved_collectives, seed=world), world)
        _check(SimulatedWorld(world, concurrent=False).run(interleaved_collectives, seed=world), world)


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("world", [2, 3])
def test_a_started_collective_completes_while_the_worker_computes(world):
    expected_sum = world * (world + 1) / 2
    expected = [(True, expected_sum, [float(r) for r in range(world)])] * world
    assert spawn(completes_while_computing, world, join_timeout=JOIN, timeout=30) == expected
    # Every simulated worker needs a compute slot to arrive: a worker that only polls keeps its own.
    assert SimulatedWorld(world, max_running=world).run(completes_while_computing) == expected


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("world", [2, 3])
def test_a_missing_peer_fails_the_wait_naming_the_rank_and_timeout_over_gloo(world):
    start = time.monotonic()
    with pytest.raises(CommunicationError, match=r"rank 0: .*timeout"):
        spawn(stall_nonblocking, world, timeout=3, join_timeout=JOIN, seconds=20)
    assert time.monotonic() - start < 60


def test_a_missing_peer_fails_the_wait_naming_the_rank_and_timeout_simulated():
    start = time.perf_counter()
    with pytest.raises(CommunicationError, match=r"rank 0: .*within the 1s collective timeout: ranks \[1\] did not arrive"):
        # Both compute at once even where torch has one thread: rank 0 must reach its wait
        # while rank 1 sleeps, or rank 1's end is reported instead of the timeout.
        SimulatedWorld(2, timeout=1.0, max_running=2).run(stall_nonblocking, seconds=3.0)
    assert time.perf_counter() - start < 3.5


def test_world_of_one_copies_and_completes_at_once():
    comm = SingleProcess()
    x = torch.arange(4.0)
    p = comm.start_all_reduce([x])
    assert isinstance(p, Pending) and p.is_completed()
    p.wait()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    recv = [torch.empty(2, 2)]
    comm.all_to_all([x], recv)
    assert recv[0].flatten().tolist() == x.tolist()
    out = [torch.empty(4)]
    comm.all_gather(x, out)
    assert torch.equal(out[0], x)
    # The worker function itself, run outside any runtime, is a world of one.
    got, expected = interleaved_collectives()
    assert _same_bits(got, expected) and current().world_size == 1


def test_bad_arguments_are_refused_before_anything_is_sent():
    def worker():
        comm = current()
        errors = []
        for call in (
            lambda: comm.all_to_all([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]),
            lambda: comm.all_to_all([torch.zeros(1), torch.zeros(1, dtype=torch.uint8)], [torch.zeros(1)] * 2),
            lambda: comm.all_to_all([torch.zeros(1), torch.zeros(1)], [torch.zeros(2), torch.zeros(2)]),
            lambda: comm.all_gather(torch.zeros(2), [torch.zeros(3), torch.zeros(2)]),
            lambda: comm.start_all_reduce([torch.zeros(1)], op="mean"),
        ):
            with pytest.raises(ValueError) as info:
                call()
            errors.append(str(info.value))
        comm.barrier()  # nothing was started: the next collective still matches
        return errors

    errors = SimulatedWorld(2).run(worker)[0]
    assert "world_size=2" in errors[0] and "one dtype" in errors[1] and "recv[0]" in errors[2]
    assert "out[0]" in errors[3] and "Invalid reduce op" in errors[4]


def test_a_simulated_all_to_all_with_pieces_that_do_not_fit_is_named():
    def worker():
        comm = current()
        n = 2 if comm.rank == 0 else 3  # rank 0 sends 2 values to rank 1, which expects 3
        comm.all_to_all([torch.zeros(1), torch.zeros(n)] if comm.rank == 0 else [torch.zeros(2), torch.zeros(1)],
                        [torch.zeros(1), torch.zeros(2)] if comm.rank == 0 else [torch.zeros(n), torch.zeros(1)])

    with pytest.raises(CommunicationError, match="rank 0 sends 2 .* to rank 1, which expects 3"):
        SimulatedWorld(2, timeout=10).run(worker)
