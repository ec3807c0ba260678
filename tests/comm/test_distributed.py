"""Multi-process tests: real gloo groups on the CPU, FileStore rendezvous, bounded by timeouts."""

import itertools
import time

import pytest
import torch

from localclip.averaging import PeriodicAverager
from localclip.comm import SimulatedWorld, SingleProcess
from localclip.errors import CommunicationError
from localclip.comm.launch import spawn

from workers import chunked_averages, collectives, fail_on_rank, reduce_with_then, stall_rank, tiny_model, train_celgc, wrapped_models_refused

JOIN = 120  # seconds: a hang fails the test instead of blocking CI


@pytest.mark.full  # gloo processes
def test_gloo_collectives():
    assert spawn(collectives, 3, join_timeout=JOIN, timeout=30) == [([6.0, 6.0, 6.0], 2.0, 2.0)] * 3


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("kwargs", [dict(period=3), dict(period=2, clip_mode="global_average", momentum=0.5), dict(algorithm="naive")])
def test_simulated_workers_equal_gloo_processes(kwargs):
    sim = SimulatedWorld(3).run(train_celgc, steps=7, **kwargs)
    real = spawn(train_celgc, 3, steps=7, join_timeout=JOIN, timeout=30, **kwargs)
    for s, r in zip(sim, real):
        assert s["rounds"] == r["rounds"] and s["bytes"] == r["bytes"] and s["clipped"] == r["clipped"]
        for k in s["state"]:
            # gloo sums in a different order than the simulation: equal up to float64 rounding.
            torch.testing.assert_close(s["state"][k], r["state"][k], rtol=1e-12, atol=1e-13)


# The fast tier's case of simulate == gloo: two processes, bit for bit.
def test_episode_with_outer_nesterov_and_bf16_simulated_equals_gloo():
    """Two workers, so that gloo's bf16 sum (a + b) is the simulation's: bit for bit."""
    kwargs = dict(algorithm="episode", period=2, outer=(0.7, 0.9, True), compression="bf16")
    sim = SimulatedWorld(2).run(train_celgc, steps=7, **kwargs)
    real = spawn(train_celgc, 2, steps=7, join_timeout=JOIN, timeout=30, **kwargs)
    for s, r in zip(sim, real):
        assert s["rounds"] == r["rounds"] == 4 + 4 and s["bytes"] == r["bytes"] and s["clipped"] == r["clipped"]
        for k in s["state"]:
            assert torch.equal(s["state"][k], r["state"][k]), k


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("world,kwargs", [
    (2, dict(period=4, fragments=2, overlap=1, outer=(0.7, 0.9, True), compression="bf16")),
    (2, dict(period=3, overlap=2, overlap_alpha=0.25)),
    (3, dict(period=4, fragments=3, overlap=3, participants=2)),
    (2, dict(period=4, fragments=2, overlap=1, overlap_merge="carry")),
    (2, dict(period=4, fragments=2, overlap=1, overlap_merge="carry", compression="int8")),
])
def test_streaming_rounds_simulated_equal_gloo_bit_for_bit(world, kwargs):
    """Rounds in flight over gloo's non-blocking all-reduce (three workers: the rank-ordered sum
    in a helper thread) give the simulation's bits; with fragments, a tensor is cut between two."""
    if kwargs.get("fragments", 1) > 1:
        model = tiny_model()
        numels = [p.numel() for p in model.parameters()] + [b.numel() for b in model.buffers() if b.is_floating_point()]
        avg = PeriodicAverager(model, kwargs["period"], group=SingleProcess(), fragments=kwargs["fragments"])
        assert any(lo not in set(itertools.accumulate(numels)) for lo, _ in avg.fragment_elements[1:])
    sim = SimulatedWorld(world).run(train_celgc, steps=9, **kwargs)
    real = spawn(train_celgc, world, steps=9, join_timeout=JOIN, timeout=30, **kwargs)
    for s, r in zip(sim, real):
        assert s["rounds"] == r["rounds"] and s["bytes"] == r["bytes"] and s["clipped"] == r["clipped"]
        for k in s["state"]:
            assert torch.equal(s["state"][k], r["state"][k]), k


@pytest.mark.full  # gloo processes
def test_then_sees_each_tensor_reduced_in_order_over_gloo_and_simulated():
    expected = [[6.0] * 5, [6.0], [6.0] * 3]
    assert spawn(reduce_with_then, 3, join_timeout=JOIN, timeout=30) == [expected] * 3
    assert SimulatedWorld(3).run(reduce_with_then) == [expected] * 3


@pytest.mark.full  # gloo processes
def test_chunked_rounds_equal_one_chunk_over_gloo():
    """Chunks of 64 bytes and of 1000 bytes (not a multiple of 4: a ragged last chunk) give the
    one-chunk average, also with a NaN on one rank and with partial participation. Not bit for
    bit: gloo's ring adds three workers' values in an order that depends on where an element
    falls in its buffer, so only float32 rounding may differ."""
    results = spawn(chunked_averages, 3, join_timeout=JOIN, timeout=30)
    for rank, out in enumerate(results):
        for case in ("finite", "nan", "partial"):
            ref, left_out = out[case, 1 << 40]
            assert torch.isfinite(ref).all(), (rank, case)
            assert left_out == (1 if case == "nan" and rank == 1 else 0)
            for size in (64, 1000):
                values, n = out[case, size]
                assert n == left_out, (rank, case, size)
                torch.testing.assert_close(values, ref, rtol=1e-6, atol=1e-7, msg=f"rank {rank}, {case}, {size} bytes")
        # Every rank holds the same average.
        assert torch.equal(out["finite", 64][0], results[0]["finite", 64][0])
    # Partial participation really averaged a subset: not the full mean.
    assert not torch.equal(results[0]["partial", 64][0], results[0]["finite", 64][0])


@pytest.mark.full  # gloo processes
def test_a_stalled_peer_times_out_with_a_clear_error():
    with pytest.raises(CommunicationError, match="timeout"):
        spawn(stall_rank, 2, timeout=3, join_timeout=JOIN, seconds=15)


@pytest.mark.full  # gloo processes
def test_a_failing_worker_is_reported_by_rank():
    with pytest.raises(ValueError, match="rank 1: boom on purpose"):
        spawn(fail_on_rank, 2, timeout=10, join_timeout=JOIN)


@pytest.mark.full  # gloo processes
def test_a_dead_peer_in_averaging_fails_naming_round_and_timeout():
    from workers import stall_in_averaging

    start = time.monotonic()
    with pytest.raises(CommunicationError, match=r"round 1.*timeout 3s"):
        spawn(stall_in_averaging, 2, timeout=3, join_timeout=JOIN, seconds=20)
    assert time.monotonic() - start < 60


@pytest.mark.full  # gloo processes
def test_nan_injected_into_one_gloo_worker_leaves_the_average_finite():
    from workers import nan_injection

    results = spawn(nan_injection, 3, timeout=30, join_timeout=JOIN)
    assert results[1]["skipped"] == 1 and results[0]["skipped"] == 0
    assert [r["nonfinite_rounds"] for r in results] == [0, 1, 0]
    for r in results:
        for k, v in r["state"].items():
            if v.is_floating_point():
                assert torch.isfinite(v).all(), k
                torch.testing.assert_close(v, results[0]["state"][k])


@pytest.mark.full  # gloo processes
def test_exit_process_flushes_and_keeps_the_status():
    """exit_process leaves without the interpreter's shutdown, so what was printed must have been
    flushed and the status must survive; without a group it only flushes and exits."""
    import subprocess
    import sys

    code = ("import sys\nfrom localclip.comm import distributed\nprint('out', end='')\nsys.stderr.write('err')\n"
            "distributed.exit_process(3)\nprint('never')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "out" and proc.stderr.endswith("err"), proc


@pytest.mark.full  # gloo processes
def test_a_model_wrapped_by_ddp_or_sharded_by_fsdp_is_refused_in_one_line():
    """DDP would all-reduce the gradients at every backward; FSDP and DTensor parameters leave each rank a shard."""
    results = spawn(wrapped_models_refused, 2, join_timeout=JOIN, timeout=30)
    for ddp, fsdp, dtensor, accepted in results:
        assert ddp.startswith("Invalid module DistributedDataParallel: it is wrapped in DistributedDataParallel") and "ddp.module" in ddp
        assert "\n" not in ddp and "\n" not in fsdp
        assert fsdp.startswith("Invalid module FSDPSequential:") and "sharded by FSDP" in fsdp
        assert dtensor == "Invalid module Sequential: its parameter '0.weight' is a DTensor, not a plain tensor: a round averages whole, unsharded models"
        assert accepted == 4
