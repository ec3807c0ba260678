r"""Rounds in flight: a fragment's all-reduce travels while the workers keep stepping.

With ``overlap=tau`` (tau >= 1 local steps; Streaming DiLoCo's overlap, Douillard et al., 2025)
a fragment's round is *started* after its step t: each worker copies the fragment's values into
a snapshot buffer, prepares what it sends from the snapshot (scaled by 1/K, checked for NaN/Inf,
compressed as the averager says) and starts the all-reduce without waiting
(:meth:`~localclip.comm.Communicator.start_all_reduce`). The workers take their next steps on
their live values; after step t + tau the round *lands*: the worker waits for the sum, turns it
into the average (outer-stepped against the fragment's own anchor, which becomes the new
anchor), and merges it into the live fragment:

.. math:: x \leftarrow \alpha\, x_{\text{local}} + (1 - \alpha)\, \tilde x

(``overlap_alpha``; :math:`\tilde x` the averaged, outer-stepped fragment). With the default
:math:`\alpha = 0` the live fragment is *replaced*: the average is of the values sent at step t,
so the tau local steps taken in between are discarded for that fragment (they still shaped the
other fragments' steps, the gradients of those tau steps, and the inner optimizer's state), and
every worker holds the same bits for it afterwards. With :math:`\alpha > 0` each worker keeps that
share of its own recent progress and the workers differ until the fragment's next round.

Checkpoints: a checkpoint taken with a round in flight waits for its transport (the sum is then
in the send buffer) and saves the received sum, unapplied, with its weight; a resumed run lands it
after the same step t + tau, so it continues bit for bit as the uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localclip.averaging.round import Round
from localclip.comm import Pending

__all__ = ["InFlight", "check", "land", "restore", "start"]


def check(overlap, period: int, alpha) -> None:
    """Refuse an overlap that would land after the fragment's next round, or an alpha outside [0, 1]."""
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"Invalid overlap: {overlap!r} (must be an integer >= 0 local steps; 0: blocking rounds)")
    if overlap >= period:
        raise ValueError(f"Invalid overlap={overlap} with period={period}: a round must land before the fragment's next one (overlap < period)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"Invalid overlap_alpha: {alpha!r} (must be in [0, 1])")
    if alpha and not overlap:
        raise ValueError(f"Invalid overlap_alpha={alpha!r} with overlap=0: it merges a round in flight (overlap >= 1)")


@dataclass
class InFlight:
    """A started round: fragment ``fragment``'s round ``index`` (0-based), started after step
    ``started``; ``expected`` workers take part; ``total`` is the weight sum once it arrived."""

    fragment: int
    index: int
    started: int
    expected: int
    pending: Pending
    total: float | None = None

    def arrive(self, rnd: Round, collective) -> None:
        """Wait for the transport (a no-op once arrived); the sum is then in ``rnd``'s send buffers."""
        if self.total is None:
            collective("model averaging (in flight)", self.pending.wait)
            self.total = float(rnd._weight)

    def state_dict(self, rnd: Round, collective) -> dict:
        """The round for a checkpoint: waits for the transport, then the received sum and weight."""
        self.arrive(rnd, collective)
        return {"fragment": self.fragment, "index": self.index, "started": self.started, "expected": self.expected,
                "total": self.total, "received": [b.sent.clone() for b in rnd.buckets]}


@torch.no_grad()
def start(rnd: Round, live: list, fragment: int, index: int, step: int, collective, on_left_out) -> tuple[InFlight, int]:
    """Snapshot the live fragment into ``rnd``'s buffers and start its round; returns the round in
    flight and its payload bytes."""
    for sent, here in zip(rnd.buckets, live):
        sent.values.copy_(here.values)
    expected = rnd.begin(index, on_left_out)
    tensors = [rnd._weight] + [b.sent for b in rnd.buckets]
    started = []
    collective("model averaging (start)", lambda: started.append(rnd.comm.start_all_reduce(tensors)))
    return InFlight(fragment, index, step, expected, started[0]), sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def land(flight: InFlight, rnd: Round, live: list, alpha: float, collective) -> None:
    """Wait for the round, make the average (outer step, new anchor) and merge it into the live
    fragment: replaced when ``alpha`` is 0, else ``alpha·local + (1 − alpha)·average``."""
    flight.arrive(rnd, collective)
    rnd.finish(flight.index, flight.total, flight.expected)
    for averaged, here in zip(rnd.buckets, live):
        if alpha == 0.0:
            here.values.copy_(averaged.values)
        else:
            torch.lerp(averaged.values, here.values, alpha, out=here.values)


def restore(state: dict, rnd: Round, comm) -> InFlight:
    """A round saved by :meth:`InFlight.state_dict`, arrived, its sum back in ``rnd``'s send buffers."""
    for b, received in zip(rnd.buckets, state["received"]):
        b.sent.copy_(received)
    rnd._weight.fill_(state["total"])
    return InFlight(state["fragment"], state["index"], state["started"], state["expected"], Pending(comm, "restored round"),
                    total=state["total"])
