"""The int8/int4 codec works a cache-sized piece of blocks at a time, and a round sends, sums,
re-encodes and decodes piece by piece: how the work or the wire is cut into pieces changes no bit
of the codes, scales, decoded values, residuals or round averages, including the sign of a block
of zeros' scale (which depends on the block's place among all the blocks)."""

import pytest
import torch

from localclip.averaging.codecs import blocks as codec_blocks
from localclip.averaging.codecs import lowbit as codec_lowbit
from localclip.averaging.codecs import BLOCK_NUMEL, ErrorFeedback, decode, encode, lowbit_average
from localclip.comm import SimulatedWorld, current

QMAX = {8: 127, 4: 7}


@pytest.fixture(autouse=True)
def one_thread():
    # On a loaded machine torch's reduction over a few blocks can take its threads a third of a
    # second to split; pieces of one block make many of them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _mixed(n, seed):
    """Normal values with blocks of zeros of both signs (some of them in the last, scalar-tail
    positions of a maximum over the blocks), a NaN block and an Inf block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    nb = -(-n // BLOCK_NUMEL)
    for b in range(nb):
        if torch.rand(1, generator=g).item() < 0.4:
            signs = torch.rand(BLOCK_NUMEL, generator=g) < torch.rand(1, generator=g)
            x[b * BLOCK_NUMEL : (b + 1) * BLOCK_NUMEL] = torch.where(signs, -0.0, 0.0)[: n - b * BLOCK_NUMEL]
    x[3 * BLOCK_NUMEL + 5] = float("nan")
    x[5 * BLOCK_NUMEL + 1] = float("inf")
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_a_block_of_zeros_has_the_scale_of_one_maximum_over_all_blocks(bits, monkeypatch):
    # 37 blocks: 32 in a maximum's vectorized runs, 5 in its scalar tail (AVX2 and AVX-512).
    n = 37 * BLOCK_NUMEL
    x = _mixed(n, 1)
    blocks = x.view(-1, BLOCK_NUMEL)
    lo, hi = torch.aminmax(blocks, dim=1)
    expected = torch.maximum(hi, lo.neg()).div(QMAX[bits])  # the scales' definition, zeros included
    zero = expected == 0
    assert zero.sum() > 5 and bool(torch.signbit(expected[zero]).any()) and not bool(torch.signbit(expected[zero]).all())
    monkeypatch.setattr(codec_blocks, "PIECE_NUMEL", 3 * BLOCK_NUMEL)  # pieces of 3 blocks
    scales = encode(x, bits).scales
    assert _same_bits(scales[zero], expected[zero])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("n", [1, 300, 37 * BLOCK_NUMEL + 77])
def test_the_pieces_change_no_bit_of_an_encoding(bits, stochastic, n, monkeypatch):
    x = _mixed(n, n) if n > 6 * BLOCK_NUMEL else torch.randn(n)

    def run():
        gen = torch.Generator().manual_seed(3) if stochastic else None
        enc = encode(x, bits, generator=gen)
        return enc.codes, enc.scales, decode(enc)

    whole = run()
    for numel in (BLOCK_NUMEL, 5 * BLOCK_NUMEL):
        monkeypatch.setattr(codec_blocks, "PIECE_NUMEL", numel)
        assert all(_same_bits(a, b) for a, b in zip(whole, run())), numel


def _rounds(world, n, bits, stochastic, weighted=False):
    def worker():
        comm = current()
        fb = ErrorFeedback(n)
        gen = torch.Generator().manual_seed(10 + comm.rank) if stochastic else None
        out = []
        for k in range(2):
            delta = _mixed(n, 7 * k + comm.rank) * (k + 1)
            delta[3 * BLOCK_NUMEL + 5] = 1.0 if comm.rank else delta[3 * BLOCK_NUMEL + 5]  # a NaN from rank 0 only
            taking_part = (k == 0 or comm.rank != 1) if weighted else None
            res = lowbit_average(comm, delta, bits, fb, generator=gen, taking_part=taking_part)
            out.append((res.average.clone(), fb.residual.clone(), fb.shard_residual.clone(), (res.bytes_sent, res.payload, res.taking_part)))
        return out

    return SimulatedWorld(world, concurrent=False).run(worker)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world,stochastic", [(2, False), pytest.param(3, True, marks=pytest.mark.full)])
def test_the_pieces_change_no_bit_of_a_round(bits, world, stochastic, monkeypatch):
    n = 29 * BLOCK_NUMEL * world + 131
    whole = _rounds(world, n, bits, stochastic)
    monkeypatch.setattr(codec_blocks, "PIECE_NUMEL", 2 * BLOCK_NUMEL)
    pieces = _rounds(world, n, bits, stochastic)
    for a, b in zip(whole, pieces):
        for (avg, res, shard, sent), (avg2, res2, shard2, sent2) in zip(a, b):
            assert sent == sent2 and _same_bits(avg, avg2) and _same_bits(res, res2) and _same_bits(shard, shard2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_wire_pieces_change_no_bit_of_a_round(bits, weighted, monkeypatch):
    n = 13 * BLOCK_NUMEL * 2 + 77
    whole = _rounds(2, n, bits, False, weighted)
    monkeypatch.setattr(codec_lowbit, "PIECE_BYTES", 3 * BLOCK_NUMEL + 50)  # 2 to 5 blocks a piece
    pieces = _rounds(2, n, bits, False, weighted)
    for a, b in zip(whole, pieces):
        for (avg, res, shard, sent), (avg2, res2, shard2, sent2) in zip(a, b):
            assert sent == sent2 and _same_bits(avg, avg2) and _same_bits(res, res2) and _same_bits(shard, shard2)
