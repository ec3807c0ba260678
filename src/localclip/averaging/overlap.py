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

``overlap_merge="carry"`` (with :math:`\alpha = 0`) keeps the tau steps instead:

.. math:: x \leftarrow \tilde x + (x_{\text{local}} - x_{\text{snapshot}})

the average of what was sent plus this worker's own progress since the snapshot, computed as
``(local − snapshot)`` before the average is made and ``+ average`` after, so the workers differ
by their tau steps until the fragment's next round, as they do inside a period. It sends nothing
more; at the landing it takes two more element-wise passes over the live fragment; the snapshot
must survive until then: a 2-byte or low-bit round sends from other buffers and leaves it as it
is, but a float round scales and sums its send buffer in place, so with ``compression="none"``
the snapshot is also copied at the start into one more buffer (one more copy of the averaged
tensors). ``"mix"`` (the default) is the merge above.

Low-bit rounds (``compression="int8"|"int4"``) are no all-reduce but two collectives, the
second fed by the first (:func:`~localclip.averaging.codecs.start_lowbit_average`): at the start each
worker encodes the snapshot's change since the anchor (its residual updated) and starts the
all-to-all; the round *advances* after step t + ceil(tau/2), where each worker waits for the
all-to-all, sums, re-encodes its shard (its shard residual updated) and starts the all-gather;
at the landing it waits for the all-gather and decodes. So the all-to-all travels during the
first ceil(tau/2) steps and the all-gather during the other floor(tau/2), each phase having
about the same bytes; with tau = 1 only the all-to-all overlaps the step, and the owner's work
and the all-gather happen at the landing. The owner's decode, sum and re-encode never overlap
compute: it runs between two steps. The phases advance at fixed steps, the same on every
worker, from the training thread: every worker issues the collectives in the same order, as a
process group needs, and no background thread touches it. The result has the bits of a
blocking low-bit round of the same snapshot (the same arithmetic in the same order), outer
step and merge as above.

Checkpoints: a checkpoint taken with a round in flight waits for its transport (a float round's
sum is then in the send buffer; a low-bit round is advanced and waited for, its residuals then
updated) and saves what arrived, unapplied, with its weight: the received sum, or the decoded
average changes, and with ``"carry"`` the snapshot as well (the landing subtracts it; a ``"mix"``
checkpoint holds none, as before); a resumed run lands it after the same step t + tau, so it
continues bit for bit as the uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localclip.averaging.round import Round
from localclip.comm import Pending
from localclip.averaging.codecs import LowbitPending, LowbitRound

__all__ = ["MERGES", "InFlight", "check", "land", "midway", "restore", "start"]

MERGES = ("mix", "carry")  # overlap_merge: see the module docstring


def check(overlap, period: int, alpha, merge: str = "mix") -> None:
    """Refuse an overlap that would land after the fragment's next round, an alpha outside [0, 1],
    or a merge that is unknown or does not apply."""
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"Invalid overlap: {overlap!r} (must be an integer >= 0 local steps; 0: blocking rounds)")
    if overlap >= period:
        raise ValueError(f"Invalid overlap={overlap} with period={period}: a round must land before the fragment's next one (overlap < period)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"Invalid overlap_alpha: {alpha!r} (must be in [0, 1])")
    if alpha and not overlap:
        raise ValueError(f"Invalid overlap_alpha={alpha!r} with overlap=0: it merges a round in flight (overlap >= 1)")
    if merge not in MERGES:
        raise ValueError(f"Invalid overlap_merge: {merge!r} (expected one of {MERGES})")
    if merge == "carry" and not overlap:
        raise ValueError("Invalid overlap_merge='carry' with overlap=0: it merges a round in flight (overlap >= 1)")
    if merge == "carry" and alpha:
        raise ValueError(f"Invalid overlap_merge='carry' with overlap_alpha={alpha!r}: carry keeps the local progress whole (overlap_alpha=0)")


def midway(overlap: int) -> int:
    """The step after its start (ceil(tau/2)) at which a low-bit round advances to its all-gather;
    with tau = 1 that is the landing, where it advances and lands at once."""
    return (overlap + 1) // 2


@dataclass
class InFlight:
    """A started round: fragment ``fragment``'s round ``index`` (0-based), started after step
    ``started``; ``expected`` workers take part; ``total`` is the weight sum once it arrived.
    A float round's transport is ``pending`` (its sum arrives in the round's send buffers); a
    low-bit round's is ``exchanges``, one per bucket, whose results arrive in ``results``. With the
    carry merge, ``origin`` holds the snapshot until the landing (one tensor per bucket slice)."""

    fragment: int
    index: int
    started: int
    expected: int
    pending: Pending | None = None
    exchanges: list[LowbitPending] | None = None
    total: float | None = None
    results: list[LowbitRound] | None = None
    origin: list[torch.Tensor] | None = None

    def advance(self, collective) -> None:
        """A low-bit round's second phase: the owners' sums, re-encoded, start their all-gather
        (a no-op for a float round, or once done)."""
        if self.exchanges is not None and self.total is None:
            collective("model averaging (in flight)", lambda: [e.advance() for e in self.exchanges])

    def arrive(self, rnd: Round, collective) -> None:
        """Wait for the transport (a no-op once arrived); a float round's sum is then in ``rnd``'s
        send buffers, a low-bit round's decoded average changes in :attr:`results`."""
        if self.total is not None:
            return
        if self.exchanges is None:
            collective("model averaging (in flight)", self.pending.wait)
            self.total = float(rnd._weight)
            return
        results = []
        collective("model averaging (in flight)", lambda: results.extend(e.wait() for e in self.exchanges))
        self.results, self.total = results, float(results[0].taking_part)

    def state_dict(self, rnd: Round, collective) -> dict:
        """The round for a checkpoint: waits for the transport, then the received sum (float) or
        the decoded average changes (low-bit; the residuals are already updated) and the weight;
        with the carry merge also the snapshot."""
        self.arrive(rnd, collective)
        received = [b.sent.clone() for b in rnd.buckets] if self.results is None else [r.average.clone() for r in self.results]
        state = {"fragment": self.fragment, "index": self.index, "started": self.started, "expected": self.expected,
                 "total": self.total, "received": received}
        if self.origin is not None:
            state["snapshot"] = [t.clone() for t in self.origin]
        return state


@torch.no_grad()
def start(rnd: Round, live: list, fragment: int, index: int, step: int, collective, on_left_out,
          origin: list | None = None) -> tuple[InFlight, int]:
    """Snapshot the live fragment into ``rnd``'s buffers and start its round; returns the round in
    flight and its payload bytes. ``origin`` (the carry merge): where the snapshot stays until the
    landing, the round's own values or, where the round sends those in place, other buffers
    (filled here)."""
    for sent, here in zip(rnd.buckets, live):
        sent.values.copy_(here.values)
    for kept, sent in zip(origin or [], rnd.buckets):
        if kept is not sent.values:
            kept.copy_(sent.values)
    if rnd.lowbit:
        exchanges = rnd.start_lowbit(index, collective, on_left_out)
        flight, nbytes = InFlight(fragment, index, step, rnd.expected(), exchanges=exchanges), sum(e.payload for e in exchanges)
    else:
        expected = rnd.begin(index, on_left_out)
        tensors = [rnd._weight] + [b.sent for b in rnd.buckets]
        started = []
        collective("model averaging (start)", lambda: started.append(rnd.comm.start_all_reduce(tensors)))
        flight, nbytes = InFlight(fragment, index, step, expected, started[0]), sum(t.numel() * t.element_size() for t in tensors)
    flight.origin = origin
    return flight, nbytes


@torch.no_grad()
def land(flight: InFlight, rnd: Round, live: list, alpha: float, collective) -> None:
    """Wait for the round, make the average (outer step, new anchor) and merge it into the live
    fragment: replaced when ``alpha`` is 0, else ``alpha·local + (1 − alpha)·average``; with the
    carry merge (``flight.origin`` set) ``average + (local − snapshot)``."""
    flight.arrive(rnd, collective)
    for kept, here in zip(flight.origin or [], live):
        here.values.sub_(kept)  # this worker's progress since the snapshot, before finish overwrites the round's values
    if flight.results is None:
        rnd.finish(flight.index, flight.total, flight.expected)
    else:
        rnd.finish_lowbit(flight.index, flight.results)
    for averaged, here in zip(rnd.buckets, live):
        if flight.origin is not None:
            here.values.add_(averaged.values)
        elif alpha == 0.0:
            here.values.copy_(averaged.values)
        else:
            torch.lerp(averaged.values, here.values, alpha, out=here.values)


def restore(state: dict, rnd: Round, comm, origin: list | None = None) -> InFlight:
    """A round saved by :meth:`InFlight.state_dict`, arrived: a float round's sum back in ``rnd``'s
    send buffers, a low-bit round's average changes as its results; with the carry merge its
    snapshot back in ``origin``."""
    flight = InFlight(state["fragment"], state["index"], state["started"], state["expected"], total=state["total"])
    if origin is not None:
        for kept, saved in zip(origin, state["snapshot"]):
            kept.copy_(saved)
        flight.origin = origin
    if rnd.lowbit:
        flight.results = [LowbitRound(r.to(b.values.device, torch.float32).clone(), 0, 0, int(state["total"]))
                          for b, r in zip(rnd.buckets, state["received"])]
        return flight
    for b, received in zip(rnd.buckets, state["received"]):
        b.sent.copy_(received)
    rnd._weight.fill_(state["total"])
    flight.pending = Pending(comm, "restored round")
    return flight
