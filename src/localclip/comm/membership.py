"""Who takes part in each round when workers leave and rejoin: failure plans, quorums, heals.

A :class:`Membership` answers, for one worker, the two questions that a changing group adds to
periodic averaging (docs/algorithm.md, "When workers leave and rejoin", says why each answer is
what it is):

* :meth:`Membership.computes` — whether the worker computes a local step (a departed worker
  does not: its shard's batches of those steps are skipped);
* :meth:`Membership.begin_round` — the round's :class:`Members`: how many workers are in its
  quorum, whether this worker's model is averaged in it, and whether this worker heals at it
  (copies a live peer's state first, then takes part with weight 0 and receives the average);
  :meth:`Membership.commit` says afterwards whether the round stands (a failed round is
  discarded and every worker keeps its pre-round state).

:class:`PlannedMembership` follows a failure plan in the simulator, deterministically: the plan
``R@A:B`` (:func:`parse_plan`) takes worker R away right after its A-th local step, before any
round at step A, and heals it at the first round at a step >= B; the steps in between are not
computed. Every worker knows the plan, so each derives the same quorum for every round from the
step of the round and of the previous one, and a resumed run follows the plan from its
checkpoint. The joiner receives its peer's state in memory (the simulated workers are threads
of one process) after a barrier, the one collective a heal adds, so that waiting for the peer
happens inside a collective. :mod:`localclip.comm.ft` implements the same interface over
torchft's quorum and checkpoint transport.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Absence", "Members", "Membership", "PlannedMembership", "check_plan", "parse_plan"]

_SPEC = re.compile(r"^\s*(\d+)\s*@\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class Absence:
    """Worker ``rank`` leaves after its ``leave``-th local step and heals at the first round at a step >= ``rejoin``."""

    rank: int
    leave: int
    rejoin: int

    def __str__(self) -> str:
        return f"{self.rank}@{self.leave}:{self.rejoin}"


@dataclass(frozen=True)
class Members:
    """One round as one worker sees it."""

    quorum: int
    """Workers in the round (a healing one included): what each scales its values by."""
    taking_part: bool
    """Whether this worker's model is averaged in the round (a healing worker's is not)."""
    healing: bool = False
    """Whether this worker copied a live peer's state at this round."""
    skip: bool = False
    """Whether the quorum's workers hold one model already (a fresh run's first round): nothing is sent."""


def parse_plan(specs: Iterable[str] | str | None) -> tuple[Absence, ...]:
    """The absences that ``specs`` (``"R@A:B"`` strings, or one comma-separated string) describe.

    Raises ``ValueError`` naming the first bad value, in one line.
    """
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    plan = []
    for spec in specs:
        m = _SPEC.match(str(spec)) if isinstance(spec, str) else None
        if m is None:
            raise ValueError(f"Invalid failure plan {spec!r}: expected RANK@LEAVE:REJOIN, e.g. 3@200:400 (steps)")
        rank, leave, rejoin = map(int, m.groups())
        if rejoin <= leave:
            raise ValueError(f"Invalid failure plan {spec!r}: the rejoin step {rejoin} must come after the leave step {leave}")
        plan.append(Absence(rank, leave, rejoin))
    return tuple(plan)


def check_plan(plan: tuple[Absence, ...], world_size: int, period: int = 1) -> None:
    """Refuse a plan that names a worker outside the group, overlaps one worker's absences, or
    may leave a round without a live worker (a heal would have no peer to copy from). An absence
    lasts at most until the first period boundary at or after its rejoin step."""
    for a in plan:
        if not 0 <= a.rank < world_size:
            raise ValueError(f"Invalid failure plan {a}: rank {a.rank} is not a worker (workers 0..{world_size - 1})")
    by_rank: dict[int, list[Absence]] = {}
    for a in sorted(plan, key=lambda a: (a.rank, a.leave)):
        earlier = by_rank.setdefault(a.rank, [])
        if earlier and a.leave < earlier[-1].rejoin + period - 1:
            raise ValueError(f"Invalid failure plan {a}: worker {a.rank} is already away then ({earlier[-1]})")
        earlier.append(a)
    # Worst case: every absence lasts until the period boundary at or after its rejoin step.
    for a in plan:
        away = {b.rank for b in plan if b.leave <= a.leave < b.rejoin + period - 1}
        if len(away) >= world_size:
            raise ValueError(f"Invalid failure plan {a}: at step {a.leave} every worker would be away ({', '.join(str(b) for b in plan if b.rank in away)})")


class Membership:
    """The interface; this base class is a fixed group where every worker takes part in every round."""

    world_size: int
    rank: int

    def attach(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]) -> None:
        """What a healing worker copies from its peer: ``state_dict()`` on the peer, ``load_state_dict`` on the joiner."""
        self._state_dict, self._load_state_dict = state_dict, load_state_dict

    def computes(self, step: int, last_round: int) -> bool:
        """Whether this worker computes local step ``step`` (1-based); ``last_round``: the step of the last round before it."""
        return True

    def begin_round(self, step: int, last_round: int) -> Members:
        """The round after step ``step`` (``last_round``: the previous round's step, 0 if none)."""
        return Members(self.world_size, True)

    can_fail = False
    """Whether a round may fail and be discarded (then the averager keeps a pre-round copy)."""

    def commit(self, error: BaseException | None = None) -> bool:
        """Whether the round just run stands (False: discard it, every worker keeps its pre-round
        state). ``error``: what the round's transport raised, if anything; a membership that
        cannot survive it raises it."""
        if error is not None:
            raise error
        return True

    def departed(self, step: int, last_round: int) -> list[int]:
        """The ranks away at local step ``step`` (for records)."""
        return []


# The simulated workers' states in transit, per simulated world (a heal in one process).
_MAILBOXES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_MAILBOX_LOCK = threading.Lock()


class PlannedMembership(Membership):
    """A failure plan in the simulator; see the module docstring.

    Args:
        plan: the absences (:func:`parse_plan`).
        period: the communication period (to check that some worker is live at every round).
        comm: this worker's simulated communicator (its world carries the states in transit).
    """

    def __init__(self, plan: tuple[Absence, ...], comm, period: int = 1):
        check_plan(plan, comm.world_size, period)
        self.plan, self.comm = tuple(plan), comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self._state_dict = self._load_state_dict = None

    @staticmethod
    def _gone(a: Absence, step: int, last_round: int) -> bool:
        """Whether ``a``'s worker is out of the round after step ``step``."""
        return a.leave <= step < a.rejoin

    @staticmethod
    def _heals(a: Absence, step: int, last_round: int) -> bool:
        """Whether ``a``'s worker heals at the round after step ``step``: the first round at a step >= rejoin."""
        return step >= a.rejoin > last_round and a.leave <= step

    def computes(self, step: int, last_round: int) -> bool:
        return self.rank not in self.departed(step, last_round)

    def departed(self, step: int, last_round: int) -> list[int]:
        # Away from the step after ``leave`` until the first round at or after ``rejoin``.
        return sorted({a.rank for a in self.plan if a.leave < step and last_round < a.rejoin})

    def begin_round(self, step: int, last_round: int) -> Members:
        gone = {a.rank for a in self.plan if self._gone(a, step, last_round)}
        healing = {a.rank for a in self.plan if self._heals(a, step, last_round)}
        if healing:
            live = set(range(self.world_size)) - gone - healing
            if not live:
                raise RuntimeError(f"failure plan: no live worker to heal ranks {sorted(healing)} from at the round after step {step}")
            self._heal(step, min(live), healing)
        quorum = self.world_size - len(gone)
        return Members(quorum, self.rank not in gone and self.rank not in healing, self.rank in healing)

    def _heal(self, step: int, source: int, healing: set[int]) -> None:
        """The live peer ``source`` leaves its state; after a barrier, each joiner loads it."""
        if self._state_dict is None:
            raise RuntimeError("PlannedMembership: nothing to heal from: call attach(state_dict, load_state_dict) first")
        with _MAILBOX_LOCK:
            box = _MAILBOXES.setdefault(self.comm.world, {})
        if self.rank == source:
            box[step] = self._state_dict()
        self.comm.barrier()
        if self.rank in healing:
            self._load_state_dict(box[step])
        self.comm.barrier()  # every joiner has loaded it: the source's copy can go
        if self.rank == source:
            box.pop(step, None)
