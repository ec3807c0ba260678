"""Language-model sharding (§4), the BPTT schedule, batch streams and partial participation (§6)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from localclip.data.sharding import (
    BPTTSchedule,
    LMBatchStream,
    batchify,
    get_batch,
    shard_index,
    worker_shard,
)
from localclip.averaging.participation import sample_participants
from localclip.errors import DataError


def _roundtrip(state):
    """A state dict as a checkpoint would give it back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------
# batchify / worker_shard
# ---------------------------------------------------------------------------------------------


def test_batchify_columns_are_contiguous_chunks():
    stream = torch.arange(103)
    data = batchify(stream, 4)
    assert data.shape == (25, 4)  # 103 // 4 = 25 rows; 3 tokens trimmed
    for j in range(4):
        assert torch.equal(data[:, j], stream[25 * j : 25 * (j + 1)])


def test_batchify_rejects_bad_arguments():
    with pytest.raises(ValueError, match="global_batch: 0"):
        batchify(torch.arange(10), 0)
    with pytest.raises(ValueError, match="1-D"):
        batchify(torch.zeros(3, 3, dtype=torch.long), 1)
    with pytest.raises(DataError, match="5 tokens"):
        batchify(torch.arange(5), 8)


@pytest.mark.parametrize("world_size,batch_size", [(1, 1), (4, 3), (8, 3), (3, 10)])
def test_shards_are_disjoint_and_cover_the_trimmed_stream(world_size, batch_size):
    stream = torch.arange(1009)
    global_batch = world_size * batch_size
    trimmed = stream[: (stream.numel() // global_batch) * global_batch]
    shards = [worker_shard(stream, rank=r, world_size=world_size, batch_size=batch_size) for r in range(world_size)]
    lengths = {s.shape for s in shards}
    assert lengths == {(trimmed.numel() // global_batch, batch_size)}  # same T: same step count
    everything = torch.cat([s.t().reshape(-1) for s in shards])
    assert everything.numel() == trimmed.numel()
    assert torch.equal(everything.sort().values, trimmed)  # each token exactly once
    # And it is exactly batchify's columns k·b..(k+1)·b.
    full = batchify(stream, global_batch)
    for r, s in enumerate(shards):
        assert torch.equal(s, full[:, r * batch_size : (r + 1) * batch_size])


def test_shards_rotate_with_epoch():
    stream, n, b = torch.arange(2000), 4, 2
    shard = {k: worker_shard(stream, rank=k, world_size=n, batch_size=b) for k in range(n)}
    for r in range(n):
        seen = []
        for e in range(n):
            s = worker_shard(stream, rank=r, world_size=n, batch_size=b, epoch=e)
            assert torch.equal(s, shard[(r + e) % n])
            seen.append(int(s[0, 0]))
        # Over N epochs a worker visits every shard once; epoch N starts the cycle again.
        assert len(set(seen)) == n
        assert torch.equal(worker_shard(stream, rank=r, world_size=n, batch_size=b, epoch=n), shard[r])
    # Within one epoch the workers still hold disjoint shards.
    firsts = {int(worker_shard(stream, rank=r, world_size=n, batch_size=b, epoch=3)[0, 0]) for r in range(n)}
    assert len(firsts) == n


def test_heterogeneous_shards_are_fixed():
    stream, n, b = torch.arange(2000), 4, 2
    for r in range(n):
        home = worker_shard(stream, rank=r, world_size=n, batch_size=b)
        for e in range(1, 6):
            assert torch.equal(worker_shard(stream, rank=r, world_size=n, batch_size=b, epoch=e, heterogeneous=True), home)
    assert shard_index(2, 4, 7, heterogeneous=True) == 2 and shard_index(2, 4, 7) == 1


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(rank=4, world_size=4, batch_size=2), ValueError, "rank: 4"),
        (dict(rank=-1, world_size=4, batch_size=2), ValueError, "rank: -1"),
        (dict(rank=0, world_size=0, batch_size=2), ValueError, "world_size: 0"),
        (dict(rank=0, world_size=2, batch_size=0), ValueError, "batch_size: 0"),
        (dict(rank=0, world_size=2, batch_size=2, epoch=-1), ValueError, "epoch: -1"),
        (dict(rank=0, world_size=8, batch_size=10), DataError, "world_size=8 x batch_size=10"),
    ],
)
def test_worker_shard_validates_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        worker_shard(torch.arange(100), **kwargs)


# ---------------------------------------------------------------------------------------------
# get_batch
# ---------------------------------------------------------------------------------------------


def test_get_batch_targets_are_next_tokens_and_clip_at_end():
    source = batchify(torch.arange(40), 2)  # [20, 2]
    data, target = get_batch(source, 3, 5)
    assert data.shape == target.shape == (5, 2)
    assert torch.equal(target, data + 1)  # arange: the next token is the id plus one
    data, target = get_batch(source, 16, 10)
    assert data.shape[0] == 3 and torch.equal(target[-1], source[-1])
    with pytest.raises(ValueError, match="i=19"):
        get_batch(source, 19, 5)


# ---------------------------------------------------------------------------------------------
# BPTT schedule
# ---------------------------------------------------------------------------------------------


def test_bptt_schedule_is_identical_for_the_same_seed():
    a, b, c = BPTTSchedule(seed=2020), BPTTSchedule(seed=2020), BPTTSchedule(seed=2021)
    xs = [a.next() for _ in range(500)]
    assert xs == [b.next() for _ in range(500)]
    assert xs != [c.next() for _ in range(500)]


def test_bptt_schedule_does_not_touch_global_rngs():
    np.random.seed(0)
    torch.manual_seed(0)
    np_state, torch_state = np.random.get_state()[1].copy(), torch.get_rng_state()
    schedule = BPTTSchedule(seed=1)
    for _ in range(100):
        schedule.next()
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_bptt_schedule_distribution():
    schedule = BPTTSchedule(70, seed=3)
    xs = np.array([schedule.next() for _ in range(20_000)])
    assert xs.min() >= 5
    assert schedule.draws == 20_000
    # int() truncates N(70, 5) (mean ~69.5) 95% of the time and N(35, 5) (~34.5) 5% of the time.
    assert abs(xs.mean() - (0.95 * 69.5 + 0.05 * 34.5)) < 0.3
    half = (xs < 52).mean()
    assert 0.04 < half < 0.06
    assert schedule.lr_scale(35) == 0.5 and schedule.lr_scale(70) == 1.0

    tight = BPTTSchedule(10, seed=0, min_len=8, std=20.0)
    assert min(tight.next() for _ in range(1000)) == 8


def test_fixed_bptt():
    schedule = BPTTSchedule(35, seed=0, variable=False)
    assert {schedule.next() for _ in range(50)} == {35}


def test_bptt_schedule_resumes_exactly():
    a = BPTTSchedule(seed=7)
    for _ in range(123):
        a.next()
    state = _roundtrip(a.state_dict())
    b = BPTTSchedule(seed=7)
    b.load_state_dict(state)
    assert [a.next() for _ in range(300)] == [b.next() for _ in range(300)]
    assert a.draws == b.draws == 423
    with pytest.raises(ValueError, match="bptt: saved 70, now 35"):
        BPTTSchedule(35, seed=7).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(bptt=0), "bptt"), (dict(min_len=0), "min_len"), (dict(p_half=1.5), "p_half"), (dict(std=-1.0), "std")],
)
def test_bptt_schedule_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BPTTSchedule(seed=0, **kwargs)


# ---------------------------------------------------------------------------------------------
# LMBatchStream
# ---------------------------------------------------------------------------------------------


def _stream(rank=0, seed=11, epoch=0, n=4, b=3, tokens=30_000):
    shard = worker_shard(torch.arange(tokens), rank=rank, world_size=n, batch_size=b, epoch=epoch)
    return LMBatchStream(shard, BPTTSchedule(seed=seed))


def test_lm_batch_stream_walks_the_shard_in_order():
    s = _stream()
    batches = list(s)
    assert len(batches) == len(s) > 0
    shard = s.shard
    i = 0
    for data, target, seq_len in batches:
        assert torch.equal(data, shard[i : i + data.size(0)])
        assert torch.equal(target, shard[i + 1 : i + 1 + data.size(0)])
        assert data.size(0) == min(seq_len, shard.size(0) - 1 - i)
        i += seq_len
    # The loop stops as the reference does: once fewer than two rows remain.
    assert i >= shard.size(0) - 2
    assert list(s) == []  # one epoch only


def test_all_workers_get_the_same_number_of_batches():
    counts = {len(list(_stream(rank=r))) for r in range(4)}
    lengths = {tuple(len_ for *_, len_ in _stream(rank=r)) for r in range(4)}
    assert len(counts) == 1 and len(lengths) == 1


def test_lm_batch_stream_resume_gives_identical_remaining_batches():
    reference = list(_stream())
    interrupted = _stream()
    it = iter(interrupted)
    for _ in range(17):
        next(it)
    state = _roundtrip(interrupted.state_dict())

    resumed = _stream()  # fresh schedule too, as after a restart
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(reference) - 17 and len(resumed) == len(reference)
    for (d1, t1, l1), (d2, t2, l2) in zip(rest, reference[17:]):
        assert l1 == l2 and torch.equal(d1, d2) and torch.equal(t1, t2)


def test_schedule_continues_across_epochs():
    # One schedule per run, one stream per epoch: epoch 1's lengths continue epoch 0's draws.
    schedule = BPTTSchedule(seed=5)
    lens = []
    for epoch in range(2):
        shard = worker_shard(torch.arange(30_000), rank=0, world_size=4, batch_size=3, epoch=epoch)
        lens += [seq_len for *_, seq_len in LMBatchStream(shard, schedule)]
    fresh = BPTTSchedule(seed=5)
    assert lens == [fresh.next() for _ in lens]


def test_lm_batch_stream_rejects_state_of_another_shard():
    state = _stream(n=4).state_dict()
    with pytest.raises(ValueError, match="same data, world size and batch size"):
        _stream(n=2).load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Partial participation
# ---------------------------------------------------------------------------------------------


def test_participants_agree_and_vary_across_rounds():
    rounds = [sample_participants(8, 3, r, seed=2020) for r in range(50)]
    assert rounds == [sample_participants(8, 3, r, seed=2020) for r in range(50)]
    for p in rounds:
        assert p == sorted(set(p)) and len(p) == 3 and all(0 <= k < 8 for k in p)
    assert len({tuple(p) for p in rounds}) > 10
    assert sorted({k for p in rounds for k in p}) == list(range(8))
    assert rounds != [sample_participants(8, 3, r, seed=2021) for r in range(50)]
    assert sample_participants(8, 8, 5, seed=0) == list(range(8))


@pytest.mark.parametrize("args,match", [((8, 0, 0, 0), "k: 0"), ((8, 9, 0, 0), "k: 9"), ((8, 2, -1, 0), "round_index")])
def test_participants_validate(args, match):
    with pytest.raises(ValueError, match=match):
        sample_participants(*args)
