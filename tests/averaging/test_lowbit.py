"""The int8/int4 block codec and lowbit_average: round-trip error, int4 packing and its edge
cases, NaN/Inf, stochastic rounding from a passed generator only, the same bits on every worker
and in simulation as in gloo processes, bytes sent against float32, and what error feedback buys."""

import pytest
import torch

from localclip.comm import SimulatedWorld, SingleProcess, current
from localclip.comm.launch import spawn
from localclip.averaging.codecs import BLOCK_NUMEL, ErrorFeedback, decode, encode, encoded_nbytes, lowbit_average

from workers import lowbit_cases

JOIN = 120
QMAX = {8: 127, 4: 7}


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# -- codec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 1001])
def test_round_trip_is_within_half_a_step_of_each_block(bits, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    enc = encode(x, bits)
    blocks = -(-n // BLOCK_NUMEL)
    assert enc.codes.dtype == torch.uint8 and enc.codes.numel() == (n if bits == 8 else (n + 1) // 2)
    assert enc.scales.dtype == torch.float32 and enc.scales.numel() == blocks
    assert enc.nbytes == encoded_nbytes(n, bits) == enc.codes.numel() + 4 * blocks
    y = decode(enc)
    assert y.dtype == torch.float32 and y.shape == x.shape
    for b in range(blocks):
        sl = slice(b * BLOCK_NUMEL, (b + 1) * BLOCK_NUMEL)
        step = x[sl].abs().max() / QMAX[bits]
        assert enc.scales[b] == step
        assert (y[sl] - x[sl]).abs().max() <= step / 2 * (1 + 1e-6)


@pytest.mark.parametrize("n", [1, 15, 16, 257, 511])
def test_int4_packs_every_code_two_per_byte_exactly(n):
    """Multiples of one step decode exactly, for every code -7..7, at even and odd positions and
    odd lengths (the last byte's high nibble is a zero code)."""
    k = torch.arange(n) % 15 - 7.0
    k[0] = 7.0  # every block of 256 holds a 7 or -7, so its step is exactly 0.5
    k[256::256] = -7.0
    x = k * 0.5
    enc = encode(x, 4)
    assert torch.equal(decode(enc), x)
    assert enc.codes.numel() == (n + 1) // 2
    if n % 2:
        assert enc.codes[-1] >> 4 == 8  # the padding code is a zero


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_decode_to_zeros_and_a_nonfinite_value_loses_its_block(bits):
    zeros = torch.zeros(300)
    enc = encode(zeros, bits)
    assert torch.equal(enc.scales, torch.zeros(2)) and _same_bits(decode(enc), zeros)

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    x[5], x[600], x[700] = float("nan"), float("inf"), -float("inf")
    x[256:512] = 0.0
    y = decode(encode(x, bits))
    lost = torch.zeros(1001, dtype=torch.bool)
    lost[0:256] = lost[512:768] = True  # blocks 0 and 2
    assert torch.isnan(y[lost]).all() and torch.isfinite(y[~lost]).all()
    assert torch.equal(y[256:512], torch.zeros(256))
    step = x[768:].abs().max() / QMAX[bits]
    assert (y[768:] - x[768:]).abs().max() <= step / 2 * (1 + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_and_draws_only_from_its_generator(bits):
    x = torch.full((256,), 0.3)
    x[0] = float(QMAX[bits])  # step 1: every other element rounds to 0 or 1
    before = torch.get_rng_state()
    a = encode(x, bits, generator=torch.Generator().manual_seed(5))
    b = encode(x, bits, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a.codes, b.codes)
    g = torch.Generator().manual_seed(6)
    mean = torch.stack([decode(encode(x, bits, generator=g))[1:] for _ in range(200)]).mean()
    assert abs(mean.item() - 0.3) < 0.01
    assert decode(encode(x, bits))[1:].eq(0).all()  # nearest rounding: always down, a bias


# -- lowbit_average ------------------------------------------------------------------------------


def _encoded_chunk(n, world, bits):
    return encoded_nbytes(-(-n // world), bits)


@pytest.mark.full  # gloo processes
@pytest.mark.parametrize("world", [2, 3])
def test_every_worker_decodes_the_same_bits_and_simulation_equals_gloo(world):
    """int8 and int4, with and without feedback, nearest and stochastic rounding, three rounds:
    gloo processes and simulated workers agree bit for bit (averages and residuals), all ranks
    hold the same average, and the bytes are the encoded chunks sent to the peers."""
    n = 50_003
    real = spawn(lowbit_cases, world, n=n, join_timeout=JOIN, timeout=60)
    sim = SimulatedWorld(world).run(lowbit_cases, n=n)
    for case in real[0]:
        bits = case[0]
        for r in range(world):
            s, g = sim[r][case], real[r][case]
            assert s["bytes"] == g["bytes"] == [2 * (world - 1) * _encoded_chunk(n, world, bits)] * 3
            for k in range(3):
                assert _same_bits(s["averages"][k], g["averages"][k]), (case, r, k)
                assert _same_bits(g["averages"][k], real[0][case]["averages"][k]), (case, r, k)
                assert torch.isfinite(g["averages"][k]).all()
            for key in ("residual", "shard_residual"):
                assert (s[key] is None) == (g[key] is None) and (s[key] is None or _same_bits(s[key], g[key])), (case, key)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_bytes_sent_against_a_float32_all_reduce(world):
    """Two workers: a float32 all-reduce sends numel * 4 bytes per round (the averager's count);
    int8 must send at most 0.27x of it, int4 at most 0.14x. More workers: compared with what a
    float32 all-reduce of the same reduce-scatter + all-gather pattern sends (2 (W-1) chunks)."""
    n = 1_000_003

    def worker(bits):
        delta = torch.randn(n, generator=torch.Generator().manual_seed(current().rank))
        return lowbit_average(current(), delta, bits, ErrorFeedback(n)).bytes_sent

    for bits, limit in ((8, 0.27), (4, 0.14)):
        sent = SimulatedWorld(world).run(worker, bits)
        assert len(set(sent)) == 1
        float32 = n * 4 if world == 2 else 2 * (world - 1) * -(-n // world) * 4
        ratio = sent[0] / float32
        assert ratio <= limit, f"{world} workers, int{bits}: {sent[0]} bytes sent per worker, {ratio:.4f}x float32's {float32}"


def test_error_feedback_tracks_the_running_sum_and_without_it_the_bias_accumulates():
    """Each worker's change has one large value per block and small ones that nearest rounding
    always sends as 0 in int4. Without feedback the running sum of decoded averages falls behind
    by the small values every round; with it, it stays within a step of the truth, and the gap is
    exactly the residuals still held (mean of the workers' residuals plus the owners' shard ones)."""
    n, rounds, small = 4 * BLOCK_NUMEL + 3, 40, 0.06

    def worker(feedback):
        comm = current()
        delta = torch.full((n,), small * (1 + comm.rank))
        delta[::BLOCK_NUMEL] = 1.0
        fb = ErrorFeedback(n) if feedback else None
        decoded, gaps = torch.zeros(n), []
        for k in range(1, rounds + 1):
            decoded += lowbit_average(comm, delta, 4, fb).average
            gaps.append((decoded - k * torch.full((n,), small * 1.5).index_fill_(0, torch.arange(0, n, BLOCK_NUMEL), 1.0)).abs().max().item())
        return gaps, decoded, None if fb is None else (fb.residual, fb.shard_residual)

    with_fb = SimulatedWorld(2).run(worker, True)
    without = SimulatedWorld(2).run(worker, False)
    gaps, decoded, _ = without[0]
    assert gaps == sorted(gaps) and gaps[-1] > 0.9 * rounds * small * 1.5  # grows every round
    gaps, decoded, _ = with_fb[0]
    assert max(gaps) < 0.2  # about one int4 step (1/7 of the block's largest value)
    truth = rounds * torch.full((n,), small * 1.5).index_fill_(0, torch.arange(0, n, BLOCK_NUMEL), 1.0)
    held = (with_fb[0][2][0] + with_fb[1][2][0]) / 2 + torch.cat([with_fb[0][2][1], with_fb[1][2][1]])[:n]
    torch.testing.assert_close(decoded, truth - held, rtol=0, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_random_changes_keep_the_residuals_bounded(bits):
    n, rounds = 3001, 30

    def worker():
        comm = current()
        g = torch.Generator().manual_seed(comm.rank)
        fb = ErrorFeedback(n)
        gap, worst = torch.zeros(n), []
        for _ in range(rounds):
            delta = torch.randn(n, generator=g)
            gap += lowbit_average(comm, delta, bits, fb).average - delta  # summed over workers below
            worst.append(fb.residual.abs().max().item())
        return gap, worst

    out = SimulatedWorld(3).run(worker)
    step = 5.0 / QMAX[bits]  # |randn| < 5 here: one step of the largest block
    for _, worst in out:
        assert max(worst) < step
    # Running sums: decoded average minus the mean of the true changes stays within about two steps.
    gap = sum(g for g, _ in out) / 3
    assert gap.abs().max() < 2 * step


def test_a_nonfinite_input_on_one_worker_is_nan_in_its_block_everywhere_and_does_not_stay():
    n, world = 3000, 3
    m = -(-n // world)

    def worker():
        comm = current()
        fb = ErrorFeedback(n)
        delta = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        if comm.rank == 1:
            delta[10], delta[1700] = float("nan"), float("inf")
        first = lowbit_average(comm, delta, 8, fb).average
        finite_after = torch.isfinite(fb.residual).all() and torch.isfinite(fb.shard_residual).all()
        second = lowbit_average(comm, torch.ones(n), 8, fb).average
        return first, bool(finite_after), second

    out = SimulatedWorld(world).run(worker)
    lost = torch.zeros(n, dtype=torch.bool)
    for i in (10, 1700):
        start = i // m * m + (i % m) // BLOCK_NUMEL * BLOCK_NUMEL
        lost[start : min(start + BLOCK_NUMEL, (i // m + 1) * m, n)] = True
    for first, finite_after, second in out:
        assert _same_bits(first, out[0][0])
        assert torch.isnan(first[lost]).all() and torch.isfinite(first[~lost]).all()
        assert finite_after and torch.isfinite(second).all()


def test_a_worker_not_taking_part_sends_zeros_with_weight_0_and_keeps_its_residual():
    """Rank 1 of 3 is left out: the others' inputs (with their residuals) are averaged over 2,
    every worker decodes the same bits and knows the count, rank 1's residual waits; the bytes
    count each chunk's 4-byte weight. Nobody taking part leaves a NaN average and a count of 0."""
    n, world = 3001, 3
    chunk = encoded_nbytes(-(-n // world), 8)

    def worker(nobody):
        comm = current()
        fb = ErrorFeedback(n)
        fb.residual.fill_(0.01 * (comm.rank + 1))
        held = fb.residual.clone()
        delta = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        res = lowbit_average(comm, delta, 8, fb, taking_part=not nobody and comm.rank != 1)
        return res, delta + held, fb.residual.clone(), held

    out = SimulatedWorld(world).run(worker, False)
    truth = (out[0][1] + out[2][1]) / 2
    step = max(out[0][1].abs().max(), out[2][1].abs().max()) / 127
    for rank, (res, _, residual, held) in enumerate(out):
        assert _same_bits(res.average, out[0][0].average) and res.taking_part == 2
        assert res.bytes_sent == (world - 1) * (2 * chunk + 4) and res.payload == world * (chunk + 4)
        assert (res.average - truth).abs().max() <= 2 * step
        assert _same_bits(residual, held) == (rank == 1)
    for res, *_ in SimulatedWorld(world).run(worker, True):
        assert res.taking_part == 0 and torch.isnan(res.average).all()


def test_reused_scratch_buffers_give_the_same_bits():
    """Three rounds with one Scratch per worker equal three without (averages, residuals, bytes),
    for int8 and int4, an odd length and a worker left out in the second round."""
    from localclip.averaging.codecs import Scratch

    n = 2 * BLOCK_NUMEL + 77

    def worker(bits, reuse):
        comm = current()
        fb, scratch, out = ErrorFeedback(n), Scratch() if reuse else None, []
        for k in range(3):
            delta = torch.randn(n, generator=torch.Generator().manual_seed(10 * k + comm.rank))
            res = lowbit_average(comm, delta, bits, fb, taking_part=not (k == 1 and comm.rank == 2), scratch=scratch)
            out.append((res.average.clone(), res.bytes_sent, fb.residual.clone(), fb.shard_residual.clone()))
        return out

    for bits in (8, 4):
        fresh, reused = SimulatedWorld(3).run(worker, bits, False), SimulatedWorld(3).run(worker, bits, True)
        for f, r in zip(fresh, reused):
            for (fa, fbytes, fres, fshard), (ra, rbytes, rres, rshard) in zip(f, r):
                assert fbytes == rbytes and _same_bits(fa, ra) and _same_bits(fres, rres) and _same_bits(fshard, rshard)


def test_a_world_of_one_sends_nothing_and_returns_the_input():
    fb = ErrorFeedback(5)
    fb.residual.fill_(0.25)
    delta = torch.arange(5.0)
    res = lowbit_average(SingleProcess(), delta, 4, fb)
    assert res.bytes_sent == 0 and torch.equal(res.average, delta + 0.25)
    assert torch.equal(fb.residual, torch.zeros(5)) and torch.equal(delta, torch.arange(5.0))


def test_error_feedback_state_round_trips():
    def worker():
        fb = ErrorFeedback(777)
        lowbit_average(current(), torch.randn(777, generator=torch.Generator().manual_seed(current().rank)), 4, fb)
        copy = ErrorFeedback(777)
        copy.load_state_dict(fb.state_dict())
        return _same_bits(copy.residual, fb.residual) and _same_bits(copy.shard_residual, fb.shard_residual)

    assert SimulatedWorld(2).run(worker) == [True, True]
    with pytest.raises(ValueError, match="778 elements, expected 777"):
        ErrorFeedback(777).load_state_dict(ErrorFeedback(778).state_dict())


def test_bad_input_is_refused_naming_the_value():
    comm = SingleProcess()
    x = torch.zeros(8)
    for kwargs, match in (
        (dict(delta=x, bits=3), "Invalid bits: 3"),
        (dict(delta=x, bits=True), "Invalid bits: True"),
        (dict(delta=x.double(), bits=8), "1-D float32 tensor, got \\(8,\\) torch.float64"),
        (dict(delta=x.view(2, 4), bits=8), "1-D float32 tensor, got \\(2, 4\\)"),
        (dict(delta=x, bits=8, feedback=ErrorFeedback(9)), "9 elements, the input 8"),
        (dict(delta=x, bits=8, block=0), "Invalid block size: 0"),
        (dict(delta=x, bits=4, block=3), "Invalid block size: 3 with bits=4"),
    ):
        with pytest.raises(ValueError, match=match):
            lowbit_average(comm, **kwargs)
    with pytest.raises(ValueError, match="Invalid numel"):
        ErrorFeedback(-1)
