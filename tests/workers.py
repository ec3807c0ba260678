"""Worker functions for multi-process tests (spawned processes must import them by name)."""

import math
import time

import torch

import localclip
from localclip.algorithms import compose
from localclip.comm import current
from localclip.optim import ClippedSGD


def tiny_model(seed=0):
    with localclip.rng.seeded(seed):  # one thread at a time: simulated workers run concurrently
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))


def fixed_batches(rank, steps, batch=8, seed=123):
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    return [(torch.randn(batch, 6, generator=gen), torch.randint(0, 3, (batch,), generator=gen)) for _ in range(steps)]


def train_celgc(steps=7, period=3, lr=0.5, gamma=0.05, clip_mode="local", momentum=0.0, algorithm="celgc", **averager_options):
    """A few CELGC (or EPISODE) steps on fixed per-rank data; returns the final state and counters."""
    torch.set_default_dtype(torch.float64)
    try:
        comm = current()
        model = tiny_model(seed=comm.rank)  # different inits: the initial broadcast must fix that
        if "outer" in averager_options:  # (lr, momentum, nesterov): one OuterSGD per worker
            averager_options["outer_optimizer"] = localclip.OuterSGD(*averager_options.pop("outer"))
        # Through the library's one builder, around the local update the test asks for.
        inner = ClippedSGD([p for p in model.parameters() if p.requires_grad], lr, gamma, momentum=momentum, clip_mode=clip_mode)
        opt = compose(algorithm, model, inner, 1 if algorithm == "naive" else period, **averager_options)
        for x, y in fixed_batches(comm.rank, steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.average()
        return {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "rounds": opt.rounds,
            "bytes": opt.bytes_communicated,
            "clipped": int(opt.optimizer.clipped_steps),
        }
    finally:
        torch.set_default_dtype(torch.float32)


def collectives():
    comm = current()
    x = torch.full((3,), float(comm.rank + 1))
    comm.all_reduce([x])
    m = torch.tensor([float(comm.rank)])
    comm.all_reduce([m], op="max")
    b = torch.tensor([float(comm.rank)])
    comm.broadcast([b], src=comm.world_size - 1)
    return x.tolist(), m.item(), b.item()


def stall_rank(rank_to_stall=1, seconds=30.0):
    """Every rank but one enters an all-reduce; the other sleeps, so the collective times out."""
    comm = current()
    if comm.rank == rank_to_stall:
        time.sleep(seconds)
        return "slept"
    comm.all_reduce([torch.ones(2)])
    return "reduced"


def fail_on_rank(rank_to_fail=1):
    comm = current()
    if comm.rank == rank_to_fail:
        raise ValueError("boom on purpose")
    comm.all_reduce([torch.ones(2)])
    return "ok"


def stall_in_averaging(seconds=20.0):
    """Rank 1 stops answering; rank 0's averaging round must fail naming the round and timeout."""
    comm = current()
    model = tiny_model()
    avg = localclip.PeriodicAverager(model, period=1)
    if comm.rank == 1:
        time.sleep(seconds)
        return "slept"
    avg.average()
    return "averaged"


def nan_injection(steps=8, period=2):
    """Rank 1 gets a NaN gradient at step 3 and NaN parameters before the round after step 6."""
    comm = current()
    model = tiny_model()
    opt = localclip.CELGC(model, lr=0.3, gamma=0.1, period=period)
    for t, (x, y) in enumerate(fixed_batches(comm.rank, steps)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if comm.rank == 1 and t == 2:
            next(model.parameters()).grad.fill_(float("nan"))
        if comm.rank == 1 and t == 5:
            with torch.no_grad():
                model[0].weight[0, 0] = float("inf")
        opt.step()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "skipped": int(opt.optimizer.skipped_steps),
        "nonfinite_rounds": opt.averager.nonfinite_rounds,
    }


def chunked_averages(chunk_sizes=(1 << 40, 64, 1000), nan_rank=1):
    """One round from the same diverged start for each chunk size, with and without a NaN on
    ``nan_rank`` and with 2 of the workers taking part: the final averages, per case and size."""
    comm = current()
    out = {}
    for case in ("finite", "nan", "partial"):
        for size in chunk_sizes:
            model = tiny_model()
            kw = {"participants": 2, "participation_seed": 3} if case == "partial" else {}
            avg = localclip.PeriodicAverager(model, period=1, chunk_bytes=size, **kw)
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * comm.rank + i)))
                if case == "nan" and comm.rank == nan_rank:
                    model[0].weight[0, 0] = math.nan
            avg.average()
            out[case, size] = (torch.cat([t.reshape(-1) for t in model.state_dict().values() if t.is_floating_point()]),
                               avg.nonfinite_rounds)
    return out


def reduce_with_then():
    """An all-reduce of three tensors with a ``then`` hook that records what it saw."""
    comm = current()
    xs = [torch.full((n,), float(comm.rank + 1)) for n in (5, 1, 3)]
    seen = []
    comm.all_reduce(xs, then=lambda t: seen.append(t.tolist()))
    return seen
