"""The :class:`PeriodicAverager`: periodic averaging of one worker's model, composed from its parts.

It owns the "every I steps, replace the model by the average" part of CELGC and of local SGD,
and composes the pieces of the package: the schedule (:mod:`.schedule`), the flat buffers
(:mod:`.buffers`), the round (:mod:`.round`, chunking) and its parts (:mod:`.parts`): the codec
(:mod:`.codecs`), the outer step (:mod:`.outer`), who takes part (:mod:`.participation`) and the
streaming layout (fragments, :mod:`.fragments`; rounds in flight, :mod:`.overlap`); and the
inner optimizer's state at a round (:mod:`.optimizer_state`). It keeps the counters and
checkpoints.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from localclip.averaging import codecs
from localclip.averaging import fragments as _fragments
from localclip.averaging import overlap as _overlap
from localclip.averaging.buffers import check_views, flatten
from localclip.averaging.codecs import Codec
from localclip.averaging.optimizer_state import OPTIMIZER_STATE_MODES, sync_optimizer_state
from localclip.averaging.outer import OuterSGD, TorchOuter, make_outer
from localclip.averaging.participation import Participation
from localclip.averaging.parts import Streaming, round_parts
from localclip.averaging.round import DEFAULT_CHUNK_BYTES, OUTER_CHUNK_BYTES, Round
from localclip.averaging.schedule import Schedule
from localclip.comm import Communicator, current
from localclip.comm.distributed import why_not_a_replica
from localclip.errors import CommunicationError

__all__ = ["PeriodicAverager"]

# The options of round_parts (parts.ROUND_OPTIONS) that name each part: a part given as an object
# and by its options at once is refused.
_NAMED_BY = {"codec": ("compression", "error_feedback"), "outer": ("outer_optimizer",),
             "participation": ("participants", "participation_seed", "skip_nonfinite"),
             "streaming": ("fragments", "overlap", "overlap_alpha", "overlap_merge")}


class PeriodicAverager:
    r"""Average a module's parameters and buffers across workers every ``period`` steps.

    Call :meth:`step` once after every optimizer step. After the ``period``-th, ``2·period``-th, …
    call (and after each of the first ``warmup_steps`` calls), every trainable parameter and,
    unless ``average_buffers=False``, every floating-point buffer (BatchNorm statistics) is
    replaced by its average over the group; in between everything stays local. This is averaging
    "at the start of every iteration t with t mod I = 0" of the paper: iteration 0 is covered by
    the construction, where every worker takes rank 0's parameters and buffers.

    The averaged tensors are re-homed into flat buffers (see :mod:`localclip.averaging.buffers`):
    create the averager after moving the module to its device, and do not re-assign
    ``param.data`` afterwards (checked at every round). ``load_state_dict`` and in-place updates
    are fine.

    Args:
        module: the worker's model.
        period: the communication period I (>= 1).
        group: the :class:`~localclip.comm.Communicator`; default :func:`localclip.comm.current`.
        codec: what a round sends (:mod:`localclip.averaging.codecs`): a
            :class:`~localclip.averaging.codecs.Codec` or a compression's name; ``"none"`` (the
            default) sends the float values; ``"bf16"``/``"fp16"`` the change since the anchor in 2
            bytes (fp16 keeps 3 more mantissa bits but overflows beyond ±65504, which counts as
            non-finite); ``"int8"``/``"int4"`` as codes with a float32 scale per 256 elements, with
            error feedback unless the codec was made with ``error_feedback=False``.
        outer: what a round does with the average (:mod:`localclip.averaging.outer`): ``None``
            (take it), an :class:`~localclip.averaging.outer.OuterSGD`, or a factory
            ``params -> torch.optim.Optimizer``.
        participation: who takes part (:class:`~localclip.averaging.participation.Participation`):
            K < world size sampled workers per round (every worker then takes their average), and
            whether a worker with NaN or Inf values is left out (the default) or raises.
        streaming: a :class:`~localclip.averaging.parts.Streaming` layout: ``fragments`` P >= 1
            split the averaged state into P fragments of about equal bytes (contiguous element
            ranges in model order, a tensor may be cut between two) that take their rounds on
            staggered schedules: fragment p after the steps t with ``(t − floor(p·period/P)) mod
            period == 0``, so that each round sends about 1/P of the model and each period syncs
            everything once (see :mod:`.fragments`; P <= period); each fragment keeps its own
            anchor and outer momentum. ``overlap`` tau starts each round without waiting and
            applies it tau local steps later (1 <= tau < period; see :mod:`.overlap`), merged as
            ``alpha·local + (1 − alpha)·average`` (``merge="mix"``, alpha 0 replaces the fragment
            by the average) or ``average + (local − snapshot)`` (``merge="carry"``, alpha 0).
            The default: blocking rounds of the whole model.
        average_buffers: also average floating-point buffers (the reference averages parameters
            only; averaging BatchNorm statistics keeps the evaluated model consistent).
        optimizer: the optimizer whose state ``optimizer_state`` refers to.
        optimizer_state: after a round, keep the optimizer's state (SGD momentum, Adam moments)
            ``"local"`` (the default: the paper's, and DiLoCo's for AdamW), ``"average"`` it
            too, or ``"reset"`` it (the next step starts afresh; see
            :func:`~localclip.averaging.optimizer_state.sync_optimizer_state`).
        warmup_steps: average after every one of the first ``warmup_steps`` steps.
        chunk_bytes: split the all-reduce into chunks of about this size, the work on each chunk
            starting as it arrives; ``None``: one all-reduce; ``"auto"`` (the default): one
            all-reduce, or chunks of ``OUTER_CHUNK_BYTES`` with an outer optimizer (see
            :mod:`localclip.averaging.round`). Results do not depend on it.
        **round_options: the parts by name, in place of the objects
            (:func:`~localclip.averaging.parts.round_parts`): ``compression`` and
            ``error_feedback`` (the codec), ``outer_optimizer`` (the outer), ``participants``,
            ``participation_seed`` and ``skip_nonfinite`` (the participation), ``fragments``,
            ``overlap``, ``overlap_alpha`` and ``overlap_merge`` (the streaming layout).

    With ``fragments > 1`` or ``overlap > 0`` a scheduled round leaves the workers' models
    different (the other fragments, or the steps taken meanwhile); :meth:`average` first lands
    any round in flight, then averages every fragment that differs, blocking, so that every
    worker holds the same model after it. Neither combines with ``warmup_steps``,
    ``optimizer_state`` other than ``"local"`` or, for ``fragments > 1``, a ``torch.optim`` outer
    optimizer (it steps all its parameters at once).

    Memory: with ``compression`` or ``outer_optimizer``, one more copy of the averaged tensors
    (the anchor, :attr:`anchor_numel`), plus the outer optimizer's state (``OuterSGD``: its
    momentum buffer, one copy of the parameters when ``momentum > 0``), plus for bf16/fp16 a
    2-byte send buffer of the same length; for int8/int4, reused round buffers (float32: the
    change, which later holds the average, the encoder's input and the decoded chunks, three
    copies; the codes, about 1/4 (int8) or 1/8 (int4) of a copy, twice) and with error feedback
    a float32 residual of the same length and one of a 1/world-size shard. With ``overlap``,
    one copy for the rounds' snapshots, and with ``overlap_merge="carry"`` and
    ``compression="none"`` one more (a float round sums into its snapshot in place). Under a
    membership that can fail (:meth:`use_membership`, ``--runtime ft``), one copy of the
    averaged tensors (and of the anchors, if any) to undo a failed round, kept from the first
    round on.

    Attributes:
        rounds: averaging rounds so far.
        bytes_communicated: payload bytes this worker has all-reduced in those rounds.
        nonfinite_rounds: rounds in which this worker was left out for non-finite parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        period: int,
        *,
        group: Communicator | None = None,
        codec: Codec | str | None = None,
        outer: OuterSGD | TorchOuter | Callable | None = None,
        participation: Participation | None = None,
        streaming: Streaming | None = None,
        average_buffers: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_state: str = "local",
        warmup_steps: int = 0,
        chunk_bytes: int | str | None = DEFAULT_CHUNK_BYTES,
        **round_options,
    ):
        given = {"codec": codec, "outer": outer, "participation": participation, "streaming": streaming}
        for part, names in _NAMED_BY.items():
            named = [n for n in names if n in round_options]
            if given[part] is not None and named:
                raise ValueError(f"Invalid {named[0]}={round_options[named[0]]!r} with {part}={given[part]!r}: give the part or its options, not both")
        parts = round_parts(**round_options)
        codec = parts.codec if codec is None else codecs.get(codec)
        outer = parts.outer if outer is None else make_outer(outer)
        participation = participation or parts.participation
        streaming = streaming or parts.streaming
        fragments, overlap = streaming.fragments, streaming.overlap
        self.schedule = Schedule(period, warmup_steps, fragments)
        streaming.check(period)
        for name, value, off in (("warmup_steps", warmup_steps, 0), ("optimizer_state", optimizer_state, "local")):
            if streaming.on and value != off:
                raise ValueError(f"Invalid {name}={value!r} with fragments={fragments!r}, overlap={overlap}: streaming rounds need {name}={off!r}")
        if chunk_bytes not in (None, "auto") and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
            raise ValueError(f"Invalid chunk_bytes: {chunk_bytes!r} (must be an integer >= 1, None or 'auto')")
        if optimizer_state not in OPTIMIZER_STATE_MODES:
            raise ValueError(f"Invalid optimizer_state: {optimizer_state!r} (expected one of {OPTIMIZER_STATE_MODES})")
        if optimizer_state != "local" and optimizer is None:
            raise ValueError(f"optimizer_state={optimizer_state!r} needs the optimizer")
        reason = why_not_a_replica(module)
        if reason is not None:
            raise ValueError(f"Invalid module {type(module).__name__}: {reason}")
        self.comm = group if group is not None else current()
        participation.check(self.comm.world_size)
        self.module = module
        self.average_buffers = average_buffers
        self.optimizer = optimizer
        self.optimizer_state = optimizer_state
        self.codec, self.outer, self.participation, self.streaming = codec, outer, participation, streaming
        self.rounds = 0
        self.bytes_communicated = 0
        self.nonfinite_rounds = 0
        if chunk_bytes == "auto":
            chunk_bytes = OUTER_CHUNK_BYTES if outer is not None else None
        self.chunk_bytes = chunk_bytes

        self._names, self._buckets = flatten(module, average_buffers)
        if not self._buckets:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters or floating-point buffers to average")
        _fragments.check(fragments, period, sum(b.values.numel() for b in self._buckets))
        if fragments > 1 and outer is not None and not outer.blockwise:
            raise ValueError(f"Invalid outer optimizer {outer!r} with fragments={fragments}: a torch.optim optimizer steps all its parameters at once; use OuterSGD")
        self.fragments, self.overlap, self.overlap_alpha = fragments, overlap, float(streaming.alpha)
        self.overlap_merge = streaming.merge
        # Streaming rounds run one Round per fragment; this one then only averages buffers (naive).
        self._round = Round(self.comm, self._buckets, codec=codecs.Plain() if streaming.on else codec, participation=participation,
                            chunk_bytes=chunk_bytes, outer=outer)
        # Every worker starts from rank 0's model (x₀ is shared).
        self._collective("initial broadcast", lambda: self.comm.broadcast([b.values for b in self._buckets], src=0))
        if codec.anchored or outer is not None:
            for b in self._buckets:
                b.anchor = b.values.clone()
                b.wire = codec.send_buffer(b.values)
        self._split = _fragments.split(self._names, self._buckets, fragments)
        self._in_flight: list[_overlap.InFlight] = []
        self._origins: list[list[torch.Tensor]] | None = None  # the carry merge's snapshots, per fragment
        if not streaming.on:
            if outer is not None:
                outer.bind([b.anchor[: b.n_params] for b in self._buckets if b.n_params])
            self._blocking = [self._round]
            return
        # One Round per fragment, over its views of the buckets; the outer step's state is bound
        # to every fragment's parameter anchors in order, so each fragment has its own momentum.
        self._live = [f.slices(self._buckets) for f in self._split]
        if outer is not None:
            outer.bind([s.anchor[: s.n_params] for live in self._live for s in live if s.n_params])
        bases = [sum(1 for live in self._live[:p] for s in live if s.n_params) for p in range(fragments)]
        outers = [outer if outer is None or fragments == 1 else _fragments.FragmentOuter(outer, base) for base in bases]
        self._blocking = [Round(self.comm, live, codec=codec, participation=participation, chunk_bytes=chunk_bytes, outer=o)
                          for live, o in zip(self._live, outers)]
        if overlap:
            # What a round in flight sends from: a snapshot of its fragment (the live values move on).
            self._snapshots = [torch.empty_like(b.values) for b in self._buckets]
            # A fragment's low-bit rounds, in flight or blocking (average()), share one residual
            # (what its codes left out goes into its next round, whichever kind) and one set of
            # round buffers: they never overlap, as a fragment's rounds are landed before the next.
            self._flying = [Round(self.comm, f.slices(self._buckets, self._snapshots), codec=codec, participation=participation,
                                  chunk_bytes=None, outer=o, shares=blocking)
                            for f, o, blocking in zip(self._split, outers, self._blocking)]
            if streaming.merge == "carry":
                # The landing subtracts the snapshot: a 2-byte or low-bit round leaves it in its own
                # values until then; a float round scales and sums those in place, so it is kept apart.
                if not codec.anchored:
                    kept = [torch.empty_like(b.values) for b in self._buckets]
                    self._origins = [[s.values for s in f.slices(self._buckets, kept)] for f in self._split]
                else:
                    self._origins = [[b.values for b in r.buckets] for r in self._flying]

    @property
    def compression(self) -> str:
        """The codec's name (what checkpoints record)."""
        return self.codec.name

    # -- the schedule --------------------------------------------------------------------------

    @property
    def period(self) -> int:
        return self.schedule.period

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    @property
    def step_count(self) -> int:
        return self.schedule.step_count

    def is_sync_step(self, step_count: int) -> bool:
        """Whether the ``step_count``-th call of :meth:`step` (1-based) ends with a round."""
        return self.schedule.is_sync_step(step_count)

    def step(self) -> bool:
        """Count one optimizer step; average if this step ends a period. Returns whether it did
        (with fragments: whether a fragment's round ran or, with overlap, started)."""
        if self.fragments == 1 and not self.overlap:
            if self.schedule.count():
                self.average()
                return True
            return False
        self.schedule.count()
        t = self.schedule.step_count
        for flight in list(self._in_flight):
            if flight.started + self.overlap == t:
                self._land(flight)
            elif flight.started + _overlap.midway(self.overlap) == t:
                flight.advance(self._collective)
        due = self.schedule.due(t)
        for p in due:
            self._start(p) if self.overlap else self._run(p)
        return bool(due)

    @property
    def in_sync(self) -> bool:
        """Whether no step has been counted since the last round (or the initial broadcast), so
        that the workers hold the same averaged tensors and a round would change nothing (with
        fragments: since every fragment's last round; and no round is in flight)."""
        return self.schedule.in_sync and not self._in_flight

    # -- a round -------------------------------------------------------------------------------

    def _collective(self, what: str, fn) -> None:
        try:
            fn()
        except CommunicationError as exc:
            raise CommunicationError(f"{what} (round {self.rounds + 1}, timeout {self.comm.timeout:g}s): {exc}") from exc

    @property
    def has_buffers(self) -> bool:
        """Whether floating-point buffers (BatchNorm statistics) are averaged with the parameters."""
        return any(isinstance(owner, tuple) for b in self._buckets for owner in b.owners)

    @torch.no_grad()
    def average(self, *, if_changed: bool = False, force: bool = False) -> None:
        """Average now, whatever the schedule (end of training, before evaluation).

        Right after a round (no step counted since), the workers already hold the average: no
        round is taken and none is counted. ``if_changed=True`` also skips the call before the
        first step (the workers hold rank 0's model); without it that call is a round, for a
        user who changed the parameters outside :meth:`step`. ``force=True`` always takes the
        round (benchmarks timing repeated rounds).

        Each worker first scales what it sends by 1/K (K: the workers expected to take part) and
        checks it for NaN/Inf in the same pass, before anything leaves it, so that a left-out
        worker's values never reach the others; then one all-reduce sums the weights and the
        values. When all K took part the sum is the average; a worker left out (not sampled, or
        non-finite) contributes zeros and weight 0, and the others rescale by K/(weight sum).
        With ``skip_nonfinite=False`` a non-finite worker raises instead (its model already
        scaled, as it is lost anyway).

        With compression each worker sends ``(x_i − a)/K`` rounded to the 2-byte format, and the
        sum is added to the anchor: per element the error against the float32 average is at
        most about ``K·u·mean_i |x_i − a|`` (``u`` the format's unit roundoff, 2⁻⁸ for bf16, 2⁻¹¹
        for fp16: one rounding of each term and one per addition; tested), and for fp16 at least
        about ``2K·2⁻²⁵`` in absolute terms: changes below fp16's normal range (6.1e-5 after the
        division by K) keep only an absolute precision, which bf16, with float32's range, avoids.
        """
        check_views(self._names, self._buckets)
        if self.comm.world_size == 1:
            return  # nothing to talk about: no round, no bytes
        if self.in_sync and (if_changed or self.rounds) and not force:
            return
        everything = force or self.in_sync  # an explicit round of what the workers already share
        for flight in list(self._in_flight):
            self._land(flight)  # early: the average must include every fragment now
        synced = self.schedule.synced_at
        for p in range(self.fragments):
            if everything or synced[p] != self.schedule.step_count:
                self._run(p, checked=True)

    def _left_out(self) -> None:
        self.nonfinite_rounds += 1

    def _run(self, p: int, checked: bool = False) -> None:
        """Fragment ``p``'s round (the whole model's without fragments), blocking."""
        if not checked:
            check_views(self._names, self._buckets)
            if self.comm.world_size == 1:
                return
        if self.membership is not None:
            return self._run_with_members(p)
        sent = self._blocking[p].run(self.rounds, self._collective, self._left_out)
        self.rounds += 1
        self.bytes_communicated += sent
        self.schedule.synced_at[p] = self.schedule.step_count
        self.bytes_communicated += sync_optimizer_state(self.optimizer, self.optimizer_state, self.comm, self._collective)

    # -- rounds under a changing group (localclip.comm.membership) ------------------------------

    membership = None  # a Membership: who takes part in each round; None: every worker, always

    def use_membership(self, membership) -> None:
        """Run every round under ``membership`` (:mod:`localclip.comm.membership`): each round's
        quorum decides who is averaged, a joiner heals at a round and takes part with weight 0,
        and a round the membership does not commit is discarded. Refuses the options whose state
        a changing group would leave undefined (docs/algorithm.md says why for each)."""
        refused = [("fragments", self.fragments, 1), ("overlap", self.overlap, 0), ("participants", self.participation.participants, None),
                   ("optimizer_state", self.optimizer_state, "local")]
        refused += [("compression", self.compression, "none")] if self.compression in codecs.LOWBIT else []
        for name, value, off in refused:
            if value != off:
                raise ValueError(f"Invalid {name}={value!r} with a changing group of workers (failure plans, --runtime ft): needs {name}={off!r}")
        self.membership = membership
        self.quorums: list[tuple[int, int, int]] = []  # (step, quorum, models averaged; 0: discarded)
        self.discarded_rounds = 0

    def take_quorums(self) -> list[tuple[int, int, int]]:
        """The (step, quorum size, models averaged) of the rounds since the last call (0 averaged:
        the round failed and was discarded)."""
        taken, self.quorums = self.quorums, []
        return taken

    def _run_with_members(self, p: int) -> None:
        """A blocking round under :attr:`membership`."""
        round_ = self._blocking[p]
        members = self.membership.begin_round(self.schedule.step_count, self.schedule.synced_at[p])
        step = self.schedule.step_count  # a joiner has its peer's counters now
        if members.skip:
            self.membership.commit()
            return
        saved = self._pre_round_state() if self.membership.can_fail else None
        round_.members, error = members, None
        try:
            sent = round_.run(self.rounds, self._collective, self._left_out)
        except CommunicationError as exc:
            error = exc
        finally:
            round_.members = None
        if not self.membership.commit(error):
            self._restore_pre_round_state(saved)
            self.discarded_rounds += 1
            self.quorums.append((step, members.quorum, 0))
            return
        self.quorums.append((step, members.quorum, int(round_._weight.item())))
        self.rounds += 1
        self.bytes_communicated += sent
        self.schedule.synced_at[p] = step

    _kept: tuple | None = None  # the pre-round copies of the values and anchors, allocated once

    @torch.no_grad()
    def _pre_round_state(self) -> tuple:
        """What a round writes: the averaged values, the anchors and the outer optimizer's state.
        The values and anchors are copied into buffers kept from round to round: a fresh copy
        each round would cost the page faults of a model-sized allocation as well (several
        times the copy's own CPU time, docs/benchmarks.md)."""
        if self._kept is None:
            self._kept = ([torch.empty_like(b.values) for b in self._buckets],
                          [None if b.anchor is None else torch.empty_like(b.anchor) for b in self._buckets])
        values, anchors = self._kept
        for b, v, a in zip(self._buckets, values, anchors):
            v.copy_(b.values)
            if a is not None:
                a.copy_(b.anchor)
        return values, anchors, None if self.outer is None else copy.deepcopy(self.outer.state_dict())

    @torch.no_grad()
    def _restore_pre_round_state(self, saved: tuple) -> None:
        values, anchors, outer = saved
        for b, v, a in zip(self._buckets, values, anchors):
            b.values.copy_(v)
            if a is not None:
                b.anchor.copy_(a)
        if outer is not None:
            self.outer.load_state_dict(outer)

    def _start(self, p: int) -> None:
        """Start fragment ``p``'s round without waiting (see :mod:`.overlap`)."""
        check_views(self._names, self._buckets)
        if self.comm.world_size == 1:
            return
        flight, sent = _overlap.start(self._flying[p], self._live[p], p, self.rounds, self.schedule.step_count,
                                      self._collective, self._left_out, None if self._origins is None else self._origins[p])
        self._in_flight.append(flight)
        self.rounds += 1
        self.bytes_communicated += sent

    def _land(self, flight: _overlap.InFlight) -> None:
        p = flight.fragment
        _overlap.land(flight, self._flying[p], self._live[p], self.overlap_alpha, self._collective)
        self._in_flight.remove(flight)
        if self.overlap_alpha == 0.0 and self.overlap_merge == "mix":
            self.schedule.synced_at[p] = self.schedule.step_count  # every worker holds the same bits

    @torch.no_grad()
    def average_buffers_only(self) -> None:
        """Average only the floating-point buffers (for algorithms whose parameters are already
        identical everywhere, like naive parallel clipping); a round only if there are any."""
        sent = self._round.buffers_only(self._collective)
        if sent:
            self.rounds += 1
            self.bytes_communicated += sent

    # -- introspection and checkpoints ---------------------------------------------------------

    @property
    def numel(self) -> int:
        """Number of elements averaged per round (parameters and buffers, weights excluded)."""
        return sum(b.values.numel() for b in self._buckets)

    @property
    def flat_buffers(self) -> Sequence[torch.Tensor]:
        return [b.values for b in self._buckets]

    @property
    def anchor_numel(self) -> int:
        """Elements of the anchor copy (0 without compression and outer optimizer)."""
        return sum(b.anchor.numel() for b in self._buckets if b.anchor is not None)

    @property
    def fragment_bytes(self) -> list[int]:
        """Bytes of each fragment's values (what one of its rounds sends, uncompressed, besides the weight)."""
        return [f.nbytes for f in self._split]

    @property
    def fragment_elements(self) -> list[tuple[int, int]]:
        """Each fragment's ``[start, stop)`` in the averaged elements' order (bucket by bucket)."""
        return [(f.start, f.stop) for f in self._split]

    @property
    def fragment_names(self) -> list[list[str]]:
        """The names of the tensors each fragment holds all or part of, in order (a tensor cut
        between two fragments is named in both)."""
        return [list(f.names) for f in self._split]

    @property
    def _feedback(self):
        """The error-feedback residuals of every round kind (one per bucket, or per fragment's
        bucket slice), in order; None without low-bit feedback."""
        feedback = [f for r in self._blocking for f in (r.feedback or [])]
        return feedback or None

    def state_dict(self) -> dict:
        """Counters, and with an anchor the anchor and the outer optimizer's state (a resume
        mid-period needs both to take the same next round). A round in flight is waited for
        and saved with its received sum, unapplied (see :mod:`.overlap`)."""
        flying = [f.state_dict(self._flying[f.fragment], self._collective) for f in self._in_flight]
        return {
            "fragments": self.fragments,
            "fragment_elements": [list(r) for r in self.fragment_elements],
            "overlap": self.overlap,
            "overlap_merge": self.overlap_merge,
            "synced_at": list(self.schedule.synced_at),
            "in_flight": flying,
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "step_count": self.step_count,
            "rounds": self.rounds,
            "bytes_communicated": self.bytes_communicated,
            "nonfinite_rounds": self.nonfinite_rounds,
            "last_round_step": self.schedule.last_round_step,
            "compression": self.compression,
            "outer": None if self.outer is None else self.outer.state_dict(),
            "anchors": [None if b.anchor is None else b.anchor.clone() for b in self._buckets],
            "error_feedback": None if self._feedback is None else [f.state_dict() for f in self._feedback],
        }

    def load_state_dict(self, state: dict) -> None:
        # Every check before any change: a refused checkpoint leaves the averager as it was.
        if state["period"] != self.period:
            raise ValueError(f"Checkpoint period {state['period']} differs from this averager's period {self.period}")
        for name, default in (("fragments", 1), ("overlap", 0), ("overlap_merge", "mix")):
            saved, ours = state.get(name, default), getattr(self, name)
            if saved != ours:
                raise ValueError(f"Checkpoint {name}={saved} differs from this averager's {name}={ours}")
        # The per-fragment state (anchors' rounds, momentum, a round in flight, the last syncs)
        # belongs to element ranges: a checkpoint split elsewhere (fragments of whole tensors
        # wrote none) cannot be resumed by this split.
        saved_elements = state.get("fragment_elements")
        ours_elements = [list(r) for r in self.fragment_elements]
        if self.fragments > 1 and saved_elements != ours_elements:
            raise ValueError(f"Checkpoint fragment element ranges {saved_elements} differ from this averager's {ours_elements}")
        compression = state.get("compression", "none")
        if compression != self.compression:
            raise ValueError(f"Checkpoint compression {compression!r} differs from this averager's {self.compression!r}")
        saved_outer = state.get("outer")
        ours = None if self.outer is None else self.outer.kind
        theirs = None if saved_outer is None else saved_outer.get("kind")
        if ours != theirs:
            raise ValueError(f"Checkpoint outer optimizer {theirs or 'none'!r} differs from this run's {ours or 'none'!r}")
        feedback, ours = state.get("error_feedback"), self._feedback
        if (feedback is None) != (ours is None):
            raise ValueError(f"Checkpoint error feedback {'on' if feedback is not None else 'off'} differs from this run's "
                             f"{'on' if ours is not None else 'off'}")
        if ours is not None:
            for f, saved in zip(ours, feedback):
                if saved["residual"].shape != f.residual.shape:
                    raise ValueError(f"Checkpoint error-feedback residual has {saved['residual'].numel()} elements, expected {f.residual.numel()}")
        if self.outer is not None:
            self.outer.load_state_dict(saved_outer)
        for f, saved in zip(ours or [], feedback or []):
            f.load_state_dict(saved)
        for b, anchor in zip(self._buckets, state.get("anchors") or [None] * len(self._buckets)):
            if b.anchor is not None and anchor is not None:
                b.anchor.copy_(anchor)
        self.schedule.warmup_steps = state["warmup_steps"]
        self.schedule.step_count = state["step_count"]
        self.rounds = state["rounds"]
        self.bytes_communicated = state["bytes_communicated"]
        self.nonfinite_rounds = state.get("nonfinite_rounds", 0)
        self.schedule.last_round_step = state.get("last_round_step", -1)
        if "synced_at" in state:
            self.schedule.synced_at = list(state["synced_at"])
        self._in_flight = [_overlap.restore(f, self._flying[f["fragment"]], self.comm, None if self._origins is None else self._origins[f["fragment"]])
                           for f in state.get("in_flight", [])]

    def __repr__(self) -> str:
        return (
            f"PeriodicAverager(period={self.period}, numel={self.numel}, world_size={self.comm.world_size}, "
            f"rounds={self.rounds}, compression={self.compression!r}, outer={self.outer!r}"
            + (f", fragments={self.fragments}, overlap={self.overlap}" if self.fragments != 1 or self.overlap else "")
            + (f", overlap_merge={self.overlap_merge!r})" if self.overlap_merge != "mix" else ")")
        )
