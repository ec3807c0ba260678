"""Outer optimizers and compressed averaging (PeriodicAverager options), and which rounds count."""

import math

import pytest
import torch

import localclip
from localclip.comm import SimulatedWorld, current
from localclip.averaging.outer import OuterSGD, TorchOuter

from workers import fixed_batches, tiny_model, train_celgc


def run_rounds(steps=7, period=3, dtype=torch.float32, lr=0.5, **options):
    """Every worker's state after each step of CELGC with the given averager options."""

    def worker():
        torch.set_default_dtype(dtype)
        try:
            comm = current()
            mine = dict(options)
            if "outer" in mine:  # one OuterSGD per worker
                mine["outer_optimizer"] = OuterSGD(*mine.pop("outer"))
            model = tiny_model(seed=comm.rank)
            opt = localclip.CELGC(model, lr=lr, gamma=0.05, period=period, **mine)
            states = []
            for x, y in fixed_batches(comm.rank, steps):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
                opt.step()
                states.append({k: v.clone() for k, v in model.state_dict().items()})
            return states, opt
        finally:
            torch.set_default_dtype(torch.float32)

    return SimulatedWorld(2).run(worker)


def test_outer_lr_one_momentum_zero_is_bit_identical_to_plain_averaging():
    # float32, so that a − (a − x̄) would differ from x̄ in the last bit for some elements.
    plain = run_rounds(steps=9)
    outer = run_rounds(steps=9, outer=(1.0, 0.0))
    for (p_states, _), (o_states, _) in zip(plain, outer):
        for p, o in zip(p_states, o_states):
            for k in p:
                assert torch.equal(p[k], o[k]), k
    # ...and the naive form of the same step is not always exact, which is why OuterSGD avoids it.
    a = torch.tensor([1.0, 3.0, -0.1])
    m = torch.tensor([1e-8, 1.0000001, 0.3])
    assert not torch.equal(a - (a - m), m)


def test_outer_sgd_and_nesterov_match_torch_sgd_as_the_outer_optimizer():
    for momentum, nesterov in ((0.9, True), (0.5, False)):
        ours = run_rounds(steps=10, period=2, dtype=torch.float64, outer=(0.7, momentum, nesterov))
        theirs = run_rounds(
            steps=10, period=2, dtype=torch.float64,
            outer_optimizer=lambda p, m=momentum, n=nesterov: torch.optim.SGD(p, lr=0.7, momentum=m, nesterov=n),
        )
        plain = run_rounds(steps=10, period=2, dtype=torch.float64)
        final = ours[0][0][-1]
        for k in final:
            torch.testing.assert_close(final[k], theirs[0][0][-1][k], rtol=1e-12, atol=1e-14)
        # the outer step changes the trajectory (else the comparison above would prove nothing)
        assert not torch.allclose(final["0.weight"], plain[0][0][-1]["0.weight"], rtol=1e-6)
        # after every round all workers hold the same model (steps 2, 4, ... end a round)
        for t in range(1, 10, 2):
            for k in final:
                assert torch.equal(ours[0][0][t][k], ours[1][0][t][k])


def _owned_storages(obj, seen=None) -> dict:
    """data_ptr -> bytes of every tensor storage reachable from ``obj``'s attributes."""
    seen = set() if seen is None else seen
    found = {}
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        found[s.data_ptr()] = s.nbytes()
        return found
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).values()
    for v in items:
        if isinstance(v, (torch.Tensor, list, tuple, dict, OuterSGD, TorchOuter)) or type(v).__name__ == "_FlatBucket":
            found.update(_owned_storages(v, seen))
    return found


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_outer_memory_is_one_copy_of_the_parameters_plus_the_momentum(momentum):
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))  # no buffers
    n = sum(p.numel() for p in model.parameters())
    plain = localclip.PeriodicAverager(model, period=2)
    plain_bytes = sum(_owned_storages(plain).values())
    model2 = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    outer = OuterSGD(0.7, momentum, nesterov=momentum > 0)
    avg = localclip.PeriodicAverager(model2, period=2, outer_optimizer=outer)
    extra = sum(_owned_storages(avg).values()) - plain_bytes
    expected = 4 * (n + (n if momentum else 0))
    assert avg.anchor_numel == n and outer.state_numel == (n if momentum else 0)
    assert extra == expected, (extra, expected)


def test_outer_state_resumes_exactly_and_a_different_outer_optimizer_is_refused():
    def worker(split):
        comm = current()
        torch.set_default_dtype(torch.float64)
        try:
            def build():
                model = tiny_model(seed=comm.rank)
                return model, localclip.CELGC(model, lr=0.5, gamma=0.05, period=3, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True))

            batches = fixed_batches(comm.rank, 10)
            model, opt = build()
            for i, (x, y) in enumerate(batches):
                if i == split:  # a checkpoint mid-period (after 4 steps, period 3), then resume
                    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
                    model, opt = build()
                    model.load_state_dict(saved["model"])
                    opt.load_state_dict(saved["opt"])
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            refused = None
            other = localclip.CELGC(tiny_model(), lr=0.5, gamma=0.05, period=3)  # no outer optimizer
            before = other.averager.state_dict()
            try:
                other.load_state_dict(opt.state_dict())
            except ValueError as exc:
                refused = str(exc)
            unchanged = other.averager.state_dict() == before
            return {k: v.clone() for k, v in model.state_dict().items()}, refused, unchanged
        finally:
            torch.set_default_dtype(torch.float32)

    straight = SimulatedWorld(2).run(worker, 99)
    resumed = SimulatedWorld(2).run(worker, 4)
    for s, r in zip(straight, resumed):
        for k in s[0]:
            assert torch.equal(s[0][k], r[0][k]), k
        assert "'nesterov'" in r[1] and "'none'" in r[1] and r[2]


def test_outer_options_are_validated_naming_the_value():
    for kwargs, needle in [((0.0,), "0.0"), ((-1.0,), "-1.0"), ((0.7, 1.0), "1.0"), ((0.7, -0.1), "-0.1"), ((0.7, 0.0, True), "nesterov")]:
        with pytest.raises(ValueError, match="Invalid outer") as info:
            OuterSGD(*kwargs)
        assert needle in str(info.value)
    with pytest.raises(ValueError, match="'zstd'"):
        localclip.PeriodicAverager(tiny_model(), period=2, compression="zstd")
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer"):
        localclip.PeriodicAverager(tiny_model(), period=2, outer_optimizer=lambda p: "adam")
    outer = OuterSGD(0.7)
    localclip.PeriodicAverager(tiny_model(), period=2, outer_optimizer=outer)
    with pytest.raises(ValueError, match="already serves another averager"):
        localclip.PeriodicAverager(tiny_model(), period=2, outer_optimizer=outer)


# -- compression ---------------------------------------------------------------------------------

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
# The absolute floor of one rounding: half the spacing of the format's subnormals (fp16's
# normal range ends at 6.1e-5; bf16 has float32's range).
ABSOLUTE_FLOOR = {"bf16": 2.0**-134, "fp16": 2.0**-25}


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4])
def test_one_compressed_average_is_within_the_formats_error_bound_and_halves_the_bytes(compression, world):
    def worker():
        comm = current()
        gen = torch.Generator().manual_seed(7)
        start = torch.randn(20000, generator=gen)  # the anchor, the same on every worker
        # each worker's change since the anchor, of varied magnitudes (as local steps give)
        change = torch.randn(20000, generator=torch.Generator().manual_seed(100 + comm.rank)) * 10.0 ** torch.randint(-6, 0, (20000,), generator=gen)
        results = {}
        for mode in ("none", compression):
            with localclip.rng.seeded(0):  # its init is overwritten, but must not draw from the shared generator
                module = torch.nn.Linear(20000, 1, bias=False)
            with torch.no_grad():
                module.weight.copy_(start.view(1, -1))
            avg = localclip.PeriodicAverager(module, period=1, compression=mode)
            with torch.no_grad():
                module.weight.add_(change.view(1, -1))
            avg.average()
            results[mode] = (module.weight.detach().reshape(-1).clone(), avg.bytes_communicated)
        return start, change, results

    out = SimulatedWorld(world).run(worker)
    start = out[0][0]
    changes = torch.stack([o[1] for o in out])
    exact = start + changes.double().mean(0).float()
    u = UNIT_ROUNDOFF[compression]
    # One rounding of each term and one per addition of the K-term sum, relative to the mean
    # magnitude of the changes (at least the format's absolute floor each); plus float32's
    # rounding of the final addition to the anchor.
    bound = world * u * changes.abs().mean(0) * (1 + u) + 2 * world * ABSOLUTE_FLOOR[compression] + 2.0**-23 * exact.abs() * 2
    for o in out:
        got, nbytes = o[2][compression]
        full, full_bytes = o[2]["none"]
        assert torch.equal(got, out[0][2][compression][0])  # all workers bit-identical
        err = (got - exact).abs()
        assert (err <= bound).all(), float((err / bound).max())
        assert err.max() > 0  # it was compressed: not the float32 result
        assert (full - exact).abs().max() <= 2.0**-22 * exact.abs().max()
        # 2 bytes per element instead of 4, plus the 4-byte weight in both
        assert nbytes - 4 == (full_bytes - 4) // 2 == 2 * 20000


def test_compressed_rounds_keep_workers_identical_and_track_the_plain_run():
    plain = run_rounds(steps=9, period=3)
    for compression in ("bf16", "fp16"):
        comp = run_rounds(steps=9, period=3, compression=compression)
        for t in (2, 5, 8):
            for k in comp[0][0][t]:
                assert torch.equal(comp[0][0][t][k], comp[1][0][t][k]), (compression, t, k)
        torch.testing.assert_close(comp[0][0][-1]["0.weight"], plain[0][0][-1]["0.weight"], rtol=0.02, atol=1e-3)
        assert comp[0][1].bytes_communicated < 0.55 * plain[0][1].bytes_communicated


# -- which rounds count ----------------------------------------------------------------------------


def test_only_rounds_that_change_something_are_counted():
    # CELGC: 6 steps, period 3: rounds after steps 3 and 6; the final average() is a no-op.
    r = SimulatedWorld(2).run(train_celgc, steps=6, period=3)
    assert r[0]["rounds"] == 2
    r = SimulatedWorld(2).run(train_celgc, steps=7, period=3)
    assert r[0]["rounds"] == 3  # after step 7 the models differ: the final average() is a round

    def naive(buffers: bool):
        comm = current()
        if buffers:
            model = tiny_model()
        else:
            with localclip.rng.seeded(0):  # the same start on every worker, whatever the thread timing
                model = torch.nn.Sequential(torch.nn.Linear(6, 3))
        opt = localclip.NaiveParallelClipping(model, lr=0.5, gamma=0.05)
        for x, y in fixed_batches(comm.rank, 5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        grad_bytes = opt.bytes_communicated
        opt.average()
        return opt.rounds, opt.bytes_communicated - grad_bytes, {k: v.clone() for k, v in model.state_dict().items()}

    rounds, extra_bytes, _ = SimulatedWorld(2).run(naive, False)[0]
    assert (rounds, extra_bytes) == (5, 0)  # identical models: the end-of-epoch average sends nothing
    out = SimulatedWorld(2).run(naive, True)
    assert out[0][0] == 6 and out[0][1] == 2 * 16 * 4  # BatchNorm statistics alone (float32)
    for k in out[0][2]:
        assert torch.equal(out[0][2][k], out[1][2][k]), k


def test_outer_rounds_default_to_chunks_and_chunking_leaves_every_result_as_it_is():
    """With an outer optimizer the default ("auto") all-reduces 8 MiB chunks, each finished as it
    arrives; from the same start, three Nesterov rounds give bit for bit the one-all-reduce result
    (a 10 MB buffer: a whole chunk and a partial one)."""
    from localclip.averaging import OUTER_CHUNK_BYTES

    def worker(chunk_bytes):
        comm = current()
        with localclip.rng.seeded(0):
            model = torch.nn.Linear(1250, 2000)
        avg = localclip.PeriodicAverager(model, period=1, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True),
                                         **({} if chunk_bytes == "default" else {"chunk_bytes": chunk_bytes}))
        g = localclip.rng.worker_generator(0, comm.rank)
        for _ in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
            avg.step()
        return avg.chunk_bytes, len(avg.flat_buffers[0]) * 4, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    default = SimulatedWorld(2).run(worker, "default")
    whole = SimulatedWorld(2).run(worker, None)
    chunk, nbytes, _ = default[0]
    assert chunk == OUTER_CHUNK_BYTES and OUTER_CHUNK_BYTES < nbytes < 2 * OUTER_CHUNK_BYTES
    for (_, _, d), (_, _, w) in zip(default, whole):
        assert torch.equal(d, w)
    assert torch.equal(default[0][2], default[1][2])
    # a plain round stays one all-reduce
    assert localclip.PeriodicAverager(tiny_model(), period=1, group=localclip.comm.SingleProcess()).chunk_bytes is None
