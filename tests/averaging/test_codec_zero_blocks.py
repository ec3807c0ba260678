"""Blocks of zeros in the int8/int4 codec: their scale's sign (+0.0 or -0.0, bits that travel) is
the one the scale's definition gives, for blocks of +0.0 only, of -0.0 only and of both, and a
change that is zero over most of the model costs no ``aminmax`` pass over its blocks of +0.0
(the case of a round of an unchanged model, or of a frozen part of one)."""

import pytest
import torch

from localclip.averaging.codecs import blocks as codec_blocks
from localclip.averaging.codecs import BLOCK_NUMEL, decode, encode

QMAX = {8: 127, 4: 7}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _zero_blocks(nb: int, seed: int) -> torch.Tensor:
    """``nb`` blocks, each one of: +0.0 only, -0.0 only, both signs, or normal values with a
    zero or two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(nb, BLOCK_NUMEL)
    for b in range(nb):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        if kind == 1:
            x[b] = -0.0
        elif kind == 2:
            x[b] = torch.where(torch.rand(BLOCK_NUMEL, generator=g) < torch.rand(1, generator=g), -0.0, 0.0)
        elif kind == 3:
            x[b] = torch.randn(BLOCK_NUMEL, generator=g)
            x[b, :2] = torch.tensor([0.0, -0.0])
    return x.view(-1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("piece_blocks", [1, 3, None])
def test_a_block_of_zeros_of_either_sign_has_the_scale_of_the_definition(bits, piece_blocks, monkeypatch):
    # 37 blocks: 32 in a maximum's vectorized runs, 5 in its scalar tail (AVX2 and AVX-512).
    x = _zero_blocks(37, seed=bits + (piece_blocks or 0))
    blocks = x.view(-1, BLOCK_NUMEL)
    lo, hi = torch.aminmax(blocks, dim=1)
    expected = torch.maximum(hi, lo.neg()).div(QMAX[bits])  # the scales' definition, zeros included
    zero = expected == 0
    positive_only = (blocks.view(torch.int32) == 0).all(dim=1)
    assert positive_only.sum() >= 3 and (zero & ~positive_only).sum() >= 3  # both kinds of blocks of zeros occur
    assert bool(torch.signbit(expected[zero]).any()) and not bool(torch.signbit(expected[zero]).all())
    if piece_blocks is not None:
        monkeypatch.setattr(codec_blocks, "PIECE_NUMEL", piece_blocks * BLOCK_NUMEL)
    enc = encode(x, bits)
    assert torch.equal(_bits(enc.scales), _bits(expected))
    assert bool((decode(enc).view(-1, BLOCK_NUMEL)[zero] == 0).all())


def _count_aminmax(monkeypatch) -> list[int]:
    """Patch ``torch.aminmax`` to record the elements each call over blocks (``dim=1``) reads."""
    seen, aminmax = [], torch.aminmax

    def counting(t, *args, **kwargs):
        if kwargs.get("dim", args[0] if args else None) is not None:
            seen.append(t.numel())
        return aminmax(t, *args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", counting)
    return seen


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_of_positive_zeros_take_no_aminmax_pass(bits, monkeypatch):
    n = 64 * BLOCK_NUMEL
    x = torch.zeros(n)
    x[5 * BLOCK_NUMEL + 7] = -0.0  # one block holding a -0.0: the only one aminmax must read
    x[9 * BLOCK_NUMEL : 10 * BLOCK_NUMEL] = 1.5
    lo, hi = torch.aminmax(x.view(-1, BLOCK_NUMEL), dim=1)
    expected = torch.maximum(hi, lo.neg()).div(QMAX[bits])
    seen = _count_aminmax(monkeypatch)
    enc = encode(x, bits)
    assert seen == [BLOCK_NUMEL]
    assert torch.equal(_bits(enc.scales), _bits(expected))
