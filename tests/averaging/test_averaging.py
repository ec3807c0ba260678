"""PeriodicAverager, CELGC and naive parallel clipping over a fake and a simulated communicator."""

import math
import time

import pytest
import torch

import localclip
from localclip.comm import Communicator, SimulatedWorld
from localclip.errors import CommunicationError

from workers import fixed_batches, tiny_model, train_celgc


class FakeCommunicator(Communicator):
    """Pretends to be rank 0 of ``world_size`` workers whose peers hold exactly what it holds.

    Records every collective, so the schedule can be checked without any real peer.
    """

    def __init__(self, world_size=4, rank=0):
        self.rank, self.world_size, self.timeout = rank, world_size, 5.0
        self.calls = []

    def _all_reduce(self, tensors, op, then):
        self.calls.append(("all_reduce", op, [t.numel() for t in tensors]))
        for t in tensors:
            t.mul_(self.world_size)
            if then is not None:
                then(t)

    def _broadcast(self, tensors, src):
        self.calls.append(("broadcast", src, [t.numel() for t in tensors]))


def sgd_steps(model, opt, averager, steps):
    synced = []
    for x, y in fixed_batches(0, steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        synced.append(averager.step())
    return synced


def test_schedule_rounds_and_bytes_with_a_fake_communicator():
    model = tiny_model()
    comm = FakeCommunicator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = localclip.PeriodicAverager(model, period=3, group=comm, warmup_steps=2)
    assert comm.calls[0][0] == "broadcast"
    synced = sgd_steps(model, opt, avg, 10)
    # warmup: after calls 1, 2; then every 3rd call counted from the end of warmup: 5, 8.
    assert synced == [True, True, False, False, True, False, False, True, False, False]
    assert avg.rounds == 4
    numel = sum(p.numel() for p in model.parameters()) + 2 * 16  # + BatchNorm running stats
    assert avg.numel == numel
    assert avg.bytes_communicated == 4 * (numel + 1) * 4
    assert [c[0] for c in comm.calls[1:]] == ["all_reduce"] * 4


def test_identical_workers_average_to_themselves():
    model = tiny_model()
    avg = localclip.PeriodicAverager(model, period=1, group=FakeCommunicator(world_size=4))
    before = [t.detach().clone() for t in model.state_dict().values()]
    avg.average()
    for b, t in zip(before, model.state_dict().values()):
        torch.testing.assert_close(t, b, rtol=0, atol=0)  # x/4 summed over 4 copies is exact


def test_parameters_become_views_of_the_flat_buffer_and_replacement_is_detected():
    model = tiny_model()
    avg = localclip.PeriodicAverager(model, period=1, group=FakeCommunicator())
    flat = avg.flat_buffers[0]
    first = next(model.parameters())
    assert first.data_ptr() == flat.data_ptr()
    model[3].weight.data = model[3].weight.data.clone()
    with pytest.raises(RuntimeError, match="'3.weight' was re-assigned"):
        avg.average()


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(period=0), "period: 0"), (dict(period=2.5), "period: 2.5"), (dict(period=1, optimizer_state="mean"), "optimizer_state: 'mean'"),
     (dict(period=1, participants=9), "participants: 9"), (dict(period=1, warmup_steps=-1), "warmup_steps: -1"),
     (dict(period=1, chunk_bytes=0), "chunk_bytes: 0"), (dict(period=1, chunk_bytes="big"), "chunk_bytes: .big.")],
)
def test_invalid_averager_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        localclip.PeriodicAverager(tiny_model(), group=FakeCommunicator(), **kwargs)


def test_module_without_parameters_is_rejected():
    with pytest.raises(ValueError, match="ReLU has no trainable parameters"):
        localclip.PeriodicAverager(torch.nn.ReLU(), 1, group=FakeCommunicator())
    with pytest.raises(ValueError, match="ReLU has no trainable parameters"):
        localclip.CELGC(torch.nn.ReLU(), lr=0.1, group=FakeCommunicator())


# -- simulated worlds ------------------------------------------------------------------------


def test_simulated_collectives_and_per_worker_random_streams():
    from workers import collectives

    assert SimulatedWorld(3).run(collectives) == [([6.0, 6.0, 6.0], 2.0, 2.0)] * 3

    def draw():
        comm = localclip.comm.current()
        torch.manual_seed(comm.rank)
        a = torch.rand(1).item()
        comm.barrier()
        return a, torch.rand(1).item()

    # Turn-taking workers each keep their own global streams, as separate processes would.
    got = SimulatedWorld(3, concurrent=False).run(draw)
    for rank, (a, b) in enumerate(got):
        gen = torch.Generator().manual_seed(rank)
        assert (a, b) == (torch.rand(1, generator=gen).item(), torch.rand(1, generator=gen).item())
    # Concurrent workers share them: run says so.
    with pytest.warns(RuntimeWarning, match="global random generator.*concurrent=False"):
        SimulatedWorld(3).run(draw)


def test_time_spent_in_then_is_not_counted_as_communication():
    def worker():
        comm = localclip.comm.current()
        comm.all_reduce([torch.ones(3), torch.ones(2)], then=lambda t: time.sleep(0.2))
        return comm.seconds

    assert all(0 <= s < 0.2 for s in SimulatedWorld(2).run(worker))


def test_simulated_failure_and_mismatch_are_reported():
    from workers import fail_on_rank

    with pytest.raises(ValueError, match="boom on purpose"):
        SimulatedWorld(3).run(fail_on_rank)

    def mismatched():
        comm = localclip.comm.current()
        comm.all_reduce([torch.ones(2 + comm.rank)])

    with pytest.raises(CommunicationError, match="mismatch"):
        SimulatedWorld(2).run(mismatched)

    def early_exit():
        comm = localclip.comm.current()
        if comm.rank == 0:
            comm.all_reduce([torch.ones(1)])

    with pytest.raises(CommunicationError, match="rank 1 finished while ranks \\[0\\] wait"):
        SimulatedWorld(2).run(early_exit)


def test_averaging_in_a_simulated_world_matches_the_mean():
    def worker():
        comm = localclip.comm.current()
        model = tiny_model(seed=comm.rank)
        avg = localclip.PeriodicAverager(model, period=1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(comm.rank)  # diverge after the initial broadcast
            model[2].running_mean.fill_(comm.rank)
        avg.average()
        return [t.clone() for t in model.state_dict().values()]

    results = SimulatedWorld(4).run(worker)
    base = tiny_model(seed=0).state_dict()
    for r in range(4):
        sd = dict(zip(base.keys(), results[r]))
        torch.testing.assert_close(sd["0.weight"], base["0.weight"] + 1.5)
        torch.testing.assert_close(sd["2.running_mean"], torch.full((16,), 1.5))


def test_buffers_can_stay_local():
    def worker():
        comm = localclip.comm.current()
        model = tiny_model()
        avg = localclip.PeriodicAverager(model, period=1, average_buffers=False)
        model[2].running_mean.fill_(comm.rank)
        avg.average()
        return model[2].running_mean[0].item()

    assert SimulatedWorld(2).run(worker) == [0.0, 1.0]


def test_nonfinite_worker_is_left_out_by_a_joint_decision():
    def worker():
        comm = localclip.comm.current()
        model = tiny_model()
        avg = localclip.PeriodicAverager(model, period=1)
        with torch.no_grad():
            model[0].weight.fill_(float(comm.rank))
            if comm.rank == 1:
                model[0].weight[0, 0] = math.nan
        avg.average()
        return model[0].weight.clone(), avg.nonfinite_rounds

    results = SimulatedWorld(3).run(worker)
    for w, _ in results:
        assert torch.isfinite(w).all() and torch.allclose(w, torch.full_like(w, 1.0))  # mean of ranks 0 and 2
    assert [n for _, n in results] == [0, 1, 0]


def test_finite_values_whose_sum_overflows_are_not_taken_for_nonfinite():
    def worker():
        comm = localclip.comm.current()
        model = tiny_model()
        avg = localclip.PeriodicAverager(model, period=1)
        with torch.no_grad():
            model[0].weight.fill_(1e38)  # finite, but their float32 sum over the tensor is inf
            if comm.rank == 1:
                model[0].bias[0] = math.inf
        avg.average()
        return model[0].weight[0, 0].item(), avg.nonfinite_rounds

    # Rank 1 (an inf) is left out; ranks 0 and 2 (huge but finite) take part.
    assert SimulatedWorld(3).run(worker) == [(pytest.approx(1e38), 0), (pytest.approx(1e38), 1), (pytest.approx(1e38), 0)]


def test_partial_participation_averages_only_the_chosen_workers():
    def worker():
        comm = localclip.comm.current()
        model = tiny_model()
        avg = localclip.PeriodicAverager(model, period=1, participants=2, participation_seed=7)
        with torch.no_grad():
            model[0].bias.fill_(float(comm.rank))
        avg.average()
        return model[0].bias[0].item()

    chosen = localclip.averaging.sample_participants(4, 2, 0, 7)
    got = SimulatedWorld(4).run(worker)
    assert got == [sum(chosen) / 2] * 4
    assert chosen == localclip.averaging.sample_participants(4, 2, 0, 7)
    assert len({tuple(localclip.averaging.sample_participants(8, 4, r, 7)) for r in range(10)}) > 1


@pytest.mark.parametrize("mode", ["average", "reset"])
def test_momentum_buffers_can_be_averaged_or_reset(mode):
    def worker():
        comm = localclip.comm.current()
        model = tiny_model()
        opt = localclip.CELGC(model, lr=0.1, gamma=1.0, period=2, momentum=0.9, optimizer_state=mode)
        for x, y in fixed_batches(comm.rank, 2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [s.get("momentum_buffer") for s in opt.state.values()]

    a, b = SimulatedWorld(2).run(worker)
    if mode == "reset":
        assert all(x is None for x in a + b)
    else:
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _lstm_naive_rounds(steps=3):
    torch.manual_seed(0)
    model = torch.nn.LSTM(4, 5)
    opt = localclip.NaiveParallelClipping(model, lr=0.1, gamma=1.0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 1, 4))[0].sum().backward()
        opt.step()
    opt.average()
    return opt.rounds, opt.averager.has_buffers


def test_only_rounds_that_communicate_something_new_are_counted():
    """An average right after a round, or naive's average of parameters the workers already
    share, sends nothing new: it counts no round. BatchNorm buffers (which each worker updates
    on its own batches) still need naive's end-of-epoch round."""
    on_boundary = SimulatedWorld(2).run(train_celgc, steps=6, period=3)
    assert on_boundary[0]["rounds"] == 2
    off_boundary = SimulatedWorld(2).run(train_celgc, steps=7, period=3)
    assert off_boundary[0]["rounds"] == 3
    naive_bn = SimulatedWorld(2).run(train_celgc, steps=4, algorithm="naive")
    assert naive_bn[0]["rounds"] == 4 + 1  # a gradient all-reduce per step, plus the buffers' round
    assert torch.equal(naive_bn[0]["state"]["2.running_mean"], naive_bn[1]["state"]["2.running_mean"])
    # nn.LSTM initialises from the global generator: the workers take turns.
    assert SimulatedWorld(2, concurrent=False).run(_lstm_naive_rounds) == [(3, False), (3, False)]


def test_celgc_counts_rounds_and_global_mode_adds_a_gradient_reduction():
    local = SimulatedWorld(2).run(train_celgc, steps=7, period=3)
    assert local[0]["rounds"] == 2 + 1  # after steps 3 and 6, plus the final average()
    glob = SimulatedWorld(2).run(train_celgc, steps=7, period=3, clip_mode="global_average")
    # one gradient all-reduce at the start of each of the 3 periods (steps 1, 4, 7)
    assert glob[0]["rounds"] == local[0]["rounds"] + 3
    assert glob[0]["bytes"] > local[0]["bytes"]
    for r in (local, glob):
        for k, v in r[0]["state"].items():
            assert torch.equal(v, r[1]["state"][k]), k


def test_period_one_gradient_averaging_equals_one_worker_on_the_concatenated_batch():
    steps, lr, gamma, n = 5, 0.5, 0.05, 3
    naive = SimulatedWorld(n).run(train_celgc, steps=steps, lr=lr, gamma=gamma, algorithm="naive")
    torch.set_default_dtype(torch.float64)
    try:
        model = tiny_model(seed=0)
        model.train()
        opt = localclip.ClippedSGD(model.parameters(), lr=lr, gamma=gamma)
        per_rank = [fixed_batches(r, steps) for r in range(n)]
        for t in range(steps):
            opt.zero_grad()
            # BatchNorm normalises per worker batch: concatenate losses, not inputs.
            loss = sum(torch.nn.functional.cross_entropy(model(per_rank[r][t][0]), per_rank[r][t][1]) for r in range(n)) / n
            loss.backward()
            opt.step()
        ref = {k: v for k, v in model.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)
    for k in ["0.weight", "0.bias", "3.weight", "3.bias"]:
        torch.testing.assert_close(naive[0]["state"][k], ref[k], rtol=1e-10, atol=1e-12)
    assert naive[0]["clipped"] > 0


def test_celgc_with_infinite_gamma_and_period_one_is_parallel_sgd():
    """Local SGD with I = 1 on identical data equals single-worker SGD (sanity of the plumbing)."""

    def worker():
        model = tiny_model()
        opt = localclip.CELGC(model, lr=0.1, gamma=math.inf, period=1)
        for x, y in fixed_batches(0, 4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model.state_dict()

    got = SimulatedWorld(2).run(worker)[0]
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in fixed_batches(0, 4):
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sgd.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v)


def test_algorithm_state_dict_round_trip():
    def worker():
        model = tiny_model()
        opt = localclip.CELGC(model, lr=0.1, gamma=0.1, period=2, clip_mode="max")
        for x, y in fixed_batches(0, 3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        sd = opt.state_dict()
        model2 = tiny_model()
        opt2 = localclip.CELGC(model2, lr=0.1, gamma=0.1, period=2, clip_mode="max")
        opt2.load_state_dict(sd)
        return opt2.rounds == opt.rounds and opt2.bytes_communicated == opt.bytes_communicated and opt2.averager.step_count == 3

    assert all(SimulatedWorld(2).run(worker))


def test_lr_set_after_load_state_dict_reaches_the_inner_optimizer():
    """A resumed run changes lr and gamma every step (decay, variable BPTT): after
    load_state_dict the facade's param_groups must still be the inner optimizer's."""
    model = tiny_model(seed=0)
    opt = localclip.CELGC(model, lr=0.5, gamma=0.05, period=2)
    opt.load_state_dict(localclip.CELGC(tiny_model(seed=0), lr=0.5, gamma=0.05, period=2).state_dict())
    for group in opt.param_groups:
        group["lr"], group["gamma"] = 0.01, 0.002
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.01] and opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
