"""A round that the membership does not commit is undone (PeriodicAverager under a membership
that can fail, as ``--runtime ft``'s): every worker keeps its pre-round values, anchors and
outer momentum to the bit, the rounds after it run as if it had not happened, and the copy that
undoes a round is allocated once, not every round."""

import torch
from torch import nn

from localclip import PeriodicAverager
from localclip.averaging.outer import OuterSGD
from localclip.comm import current
from localclip.comm.membership import Members, Membership
from localclip.comm.simulated import SimulatedWorld


class Discarding(Membership):
    """Every worker in every round; the rounds numbered in ``discard`` (1-based) do not commit."""

    can_fail = True

    def __init__(self, comm, discard):
        self.rank, self.world_size, self.discard, self.count = comm.rank, comm.world_size, set(discard), 0

    def begin_round(self, step, last_round):
        return Members(self.world_size, True)

    def commit(self, error=None):
        if error is not None:
            raise error
        self.count += 1
        return self.count not in self.discard


def _models():
    # Built here, not in the workers: a module's initialisation draws from torch's global
    # generator; the same start in every run, from a generator of its own.
    models = [nn.Linear(6, 3) for _ in range(2)]
    with torch.no_grad():
        for model in models:
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return models


def _state(averager, model):
    outer = averager.outer.state_dict()["buffers"]
    return ([p.detach().clone() for p in model.parameters()], [b.anchor.clone() for b in averager._buckets], [b.clone() for b in outer])


def _run(moves, discard):
    """Two workers; before round r each sets its parameters to its own values for ``moves[r]``,
    then averages. Per round, each worker's state before and after it, and its discarded count."""

    models = _models()

    def worker():
        comm = current()
        model = models[comm.rank]
        averager = PeriodicAverager(model, period=1, group=comm, outer=OuterSGD(0.7, 0.9, nesterov=True))
        averager.use_membership(Discarding(comm, discard))
        rounds = []
        for move in moves:
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * move + 10 * comm.rank + i)))
            before = _state(averager, model)
            averager.average(force=True)
            rounds.append((before, _state(averager, model)))
        return rounds, averager.discarded_rounds

    return SimulatedWorld(2).run(worker)


def _same(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_a_discarded_round_leaves_values_anchors_and_outer_momentum_as_they_were():
    for rounds, discarded in _run([1, 2, 3], discard={2}):
        assert discarded == 1
        assert _same(*rounds[1])  # the discarded round: nothing moved
        assert not _same(*rounds[0]) and not _same(*rounds[2])  # the committed rounds did


def test_the_rounds_after_a_discarded_one_run_as_if_it_had_not_happened():
    # Anchors and outer momentum carry from round to round: after a discarded round 2, round 3
    # must give what it gives right after round 1.
    with_discard, without = _run([1, 2, 3], discard={2}), _run([1, 3], discard=set())
    for rank in range(2):
        assert _same(with_discard[rank][0][2][1], without[rank][0][1][1])
        assert not _same(with_discard[rank][0][2][1], _run([1, 2, 3], discard=set())[rank][0][2][1])


def test_the_copy_that_undoes_a_round_is_allocated_once():
    models = _models()

    def worker():
        comm = current()
        model = models[comm.rank]
        averager = PeriodicAverager(model, period=1, group=comm, outer=OuterSGD(0.7, 0.9))
        averager.use_membership(Discarding(comm, ()))
        first, second = averager._pre_round_state(), averager._pre_round_state()  # both held
        return [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a, b in zip(first[0] + first[1], second[0] + second[1])]

    for same in SimulatedWorld(2).run(worker):
        assert same and all(same)
