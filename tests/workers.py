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


# -- all_to_all, all_gather and non-blocking collectives (tests/comm/test_comm_collectives.py) ---------


def spread_values(n, *key):
    """``n`` values of magnitudes 1e-3 to 1e3, so that the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(sum(k * 7919**i for i, k in enumerate(key, 1)) % (1 << 62))
    return torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g).float())


def _rank_order_sum(n, world, *key):
    total = spread_values(n, key[0], 0, *key[1:]).clone()
    for k in range(1, world):
        total.add_(spread_values(n, key[0], k, *key[1:]))
    return total


def _local_work(*key):
    a = spread_values(128 * 128, *key).view(128, 128) / 1e3
    for _ in range(4):
        a = torch.tanh(a @ a)
    return a.sum()


def interleaved_collectives(seed=0):
    """Non-blocking all-reduces (sum and max), all-to-all and all-gather, started before and waited
    for after local work and blocking collectives, waited for in a rank-dependent order; also
    all-to-all pieces of different sizes, in float32 and uint8. Returns the results and what
    they must be (sums in rank order, recomputed from every rank's inputs)."""
    comm = current()
    world, r = comm.world_size, comm.rank
    sizes = (1000, 7, 1)
    reduced = [spread_values(n, seed, r, i) for i, n in enumerate(sizes)]
    p_sum = comm.start_all_reduce(reduced)
    peak = spread_values(5, seed, r, 9)
    p_max = comm.start_all_reduce([peak], op="max")
    _local_work(seed, r)
    # Rank i sends i + 2j + 1 values to rank j.
    send = [spread_values(r + 2 * j + 1, seed, r, 100 + j) for j in range(world)]
    recv = [torch.empty(i + 2 * r + 1) for i in range(world)]
    p_a2a = comm.start_all_to_all(send, recv)
    blocking = spread_values(11, seed, r, 50)
    comm.all_reduce([blocking])
    bsend = [torch.full((4,), 16 * r + j, dtype=torch.uint8) for j in range(world)]
    brecv = [torch.empty(4, dtype=torch.uint8) for _ in range(world)]
    comm.all_to_all(bsend, brecv)
    mine = spread_values(6, seed, r, 60)
    gathered = torch.empty(world, 6)
    p_gather = comm.start_all_gather(mine, list(gathered.unbind(0)))
    _local_work(seed, r, 1)
    pending = [p_sum, p_max, p_a2a, p_gather]
    for p in pending if r % 2 == 0 else pending[::-1]:
        p.wait()
    assert all(p.is_completed() for p in pending)
    expected = {
        "reduced": [_rank_order_sum(n, world, seed, i) for i, n in enumerate(sizes)],
        "peak": torch.stack([spread_values(5, seed, k, 9) for k in range(world)]).amax(0),
        "recv": [spread_values(i + 2 * r + 1, seed, i, 100 + r) for i in range(world)],
        "blocking": _rank_order_sum(11, world, seed, 50),
        "brecv": [torch.full((4,), 16 * i + r, dtype=torch.uint8) for i in range(world)],
        "gathered": torch.stack([spread_values(6, seed, k, 60) for k in range(world)]),
    }
    got = {"reduced": reduced, "peak": peak, "recv": recv, "blocking": blocking, "brecv": brecv, "gathered": gathered}
    return got, expected


def completes_while_computing(n=4096, seconds=20.0):
    """Start a sum and a gather, then only compute (poll, no collective call) until both are
    complete: the transport (or the last simulated worker to arrive) finishes them meanwhile."""
    comm = current()
    x = torch.full((n,), float(comm.rank + 1))
    out = torch.empty(comm.world_size, 3)
    pending = [comm.start_all_reduce([x]), comm.start_all_gather(torch.full((3,), float(comm.rank)), list(out.unbind(0)))]
    deadline = time.monotonic() + seconds
    while not all(p.is_completed() for p in pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    completed = all(p.is_completed() for p in pending)
    for p in pending:
        p.wait()
    return completed, x[0].item(), out[:, 0].tolist()


def stall_nonblocking(rank_to_stall=1, seconds=15.0):
    """Every rank but one starts a non-blocking all-reduce, computes, then waits for it."""
    comm = current()
    if comm.rank == rank_to_stall:
        time.sleep(seconds)
        return "slept"
    pending = comm.start_all_reduce([torch.ones(10)])
    _local_work(comm.rank)
    pending.wait()
    return "reduced"


# -- low-bit averaging (tests/averaging/test_lowbit.py) ---------------------------------------------------


def lowbit_cases(n=50_003, rounds=3, seed=0):
    """Rounds of lowbit_average for int8 and int4, with and without error feedback, with nearest
    and stochastic rounding: every average, the bytes sent and the final residuals."""
    from localclip.averaging.codecs import ErrorFeedback, lowbit_average

    comm = current()
    out = {}
    for bits in (8, 4):
        for feedback in (True, False):
            for stochastic in (False, True):
                fb = ErrorFeedback(n) if feedback else None
                gen = torch.Generator().manual_seed(seed + 31 * comm.rank) if stochastic else None
                averages, sent = [], []
                for k in range(rounds):
                    delta = spread_values(n, seed, comm.rank, k) / 1e3
                    res = lowbit_average(comm, delta, bits, fb, generator=gen)
                    averages.append(res.average)
                    sent.append(res.bytes_sent)
                out[bits, feedback, stochastic] = {
                    "averages": averages,
                    "bytes": sent,
                    "residual": None if fb is None else fb.residual,
                    "shard_residual": None if fb is None else fb.shard_residual,
                }
    return out


def lowbit_training(cases, steps=8, period=2):
    """Float32 CELGC runs with low-bit rounds, one per case (a dict of averager options, plus
    ``outer``: (lr, momentum, nesterov), ``split``: the step before which the run is checkpointed
    and rebuilt from the checkpoint, ``nan_at``: (rank, step) whose parameters get a NaN before
    that step's round). Returns, per case, the final state, counters and error-feedback state."""
    comm = current()
    out = []
    for case in cases:
        case = dict(case)
        split, nan_at, outer = case.pop("split", None), case.pop("nan_at", None), case.pop("outer", None)

        def build():
            model = tiny_model(seed=comm.rank)
            options = dict(case)
            if outer is not None:
                options["outer_optimizer"] = localclip.OuterSGD(*outer)
            inner = ClippedSGD([p for p in model.parameters() if p.requires_grad], 0.5, 0.05, momentum=0.5)
            return model, compose("celgc", model, inner, period, **options)

        model, alg = build()
        for t, (x, y) in enumerate(fixed_batches(comm.rank, steps)):
            if t == split:
                saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "alg": alg.state_dict()}
                model, alg = build()
                model.load_state_dict(saved["model"])
                alg.load_state_dict(saved["alg"])
            alg.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if nan_at == (comm.rank, t):
                _step_with_nan(model, alg)
            else:
                alg.step()
        alg.average()
        feedback = alg.averager.state_dict()["error_feedback"]
        out.append({
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "rounds": alg.rounds,
            "bytes": alg.bytes_communicated,
            "nonfinite_rounds": alg.averager.nonfinite_rounds,
            "feedback": feedback,
        })
    return out


def _step_with_nan(model, alg):
    alg.optimizer.step()  # the local step, then a NaN in the parameters before the round
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    alg._round_started = alg.averager.step()


def wrapped_models_refused():
    """The refusals of a model wrapped for DDP or sharded by FSDP (run under spawn: both need a group)."""
    from torch.distributed.fsdp import fully_shard

    from localclip.algorithms import CELGC

    errors = []
    for wrap in (torch.nn.parallel.DistributedDataParallel, fully_shard):
        try:
            CELGC(wrap(tiny_model()), lr=0.5, gamma=0.05, period=4)
        except ValueError as exc:
            errors.append(str(exc))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    tp = tiny_model()  # one parameter turned into a DTensor, as tensor parallelism does
    tp[0].weight = torch.nn.Parameter(distribute_tensor(tp[0].weight.detach(), init_device_mesh("cpu", (2,)), [Replicate()]))
    try:
        CELGC(tp, lr=0.5, gamma=0.05, period=4)
    except ValueError as exc:
        errors.append(str(exc))
    # The model inside the DDP wrapper is accepted.
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_model())
    errors.append(CELGC(ddp.module, lr=0.5, gamma=0.05, period=4).averager.period)
    return errors


def collectives_in_one_buffer():
    """all_to_all and all_gather over rows of one buffer (each row beginning where the one before
    ends) and over separate tensors of the same values: both results, and whether the buffer's
    own rows hold them (received in place, not into a copy)."""
    comm = current()
    world, rank = comm.world_size, comm.rank
    send = (torch.arange(world * 5, dtype=torch.uint8) + 40 * rank).view(world, 5)
    recv = torch.zeros(world * 5, dtype=torch.uint8)
    rows = recv.view(world, 5)
    comm.start_all_to_all(list(send.unbind(0)), list(rows.unbind(0))).wait()
    apart = [torch.zeros(5, dtype=torch.uint8) for _ in range(world)]
    comm.all_to_all([t.clone() for t in send.unbind(0)], apart)
    gathered = torch.zeros(world * 3, dtype=torch.float32)
    comm.start_all_gather(torch.full((3,), rank + 0.5), list(gathered.view(world, 3).unbind(0))).wait()
    gathered_apart = [torch.zeros(3) for _ in range(world)]
    comm.all_gather(torch.full((3,), rank + 0.5), gathered_apart)
    return {"recv": recv, "apart": torch.cat(apart), "gathered": gathered, "gathered_apart": torch.cat(gathered_apart)}
