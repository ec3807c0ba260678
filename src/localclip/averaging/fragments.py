"""Streaming fragments: the averaged state split into P parts that sync on staggered schedules.

With ``fragments=P`` (Streaming DiLoCo, Douillard et al., 2025) the averaged state is split into
P *fragments* of about equal bytes: P contiguous ranges of *elements* of the averaged state in
model order (bucket by bucket; in a bucket, the parameters in the module's order, then the
floating-point buffers), so that a tensor may be cut between two fragments. Fragment p takes its
round after the steps t with ``(t − o_p) mod period == 0``, t ≥ o_p, where
``o_p = floor(p·period/P)`` (:func:`offsets`): every period still syncs each fragment once, and
each round sends about 1/P of the model. P must be at most the period (so that no two fragments
share an offset) and at most the number of averaged elements (no fragment is empty).

Why elements rather than whole tensors: one tensor dominates typical models, so fragments of
whole tensors cannot shrink a round below that tensor. At P = 4 (target: 1/P + 5 % = 0.2625)
the largest fragment of whole tensors is 0.754 of a full round for ptb-small (its tied
10000×200 embedding is 75 % of the model), 0.908 for wt2-converge, 0.760 for ptb-gpt-small and
0.322 for AWD-LSTM. Cut at elements, every fragment is within 1/P + 2.5 % of the state's bytes
(:func:`split`; one element more where the model has fewer than about 40·P elements): at P = 4
the largest round is 0.253, 0.250, 0.253 and 0.254 of a full one for those four models.

A fragment is one :class:`BucketSlice` per flat bucket it touches, a view of the bucket's
values, anchor and send buffer over an element range, so that a
:class:`~localclip.averaging.round.Round` runs on a fragment as on whole buckets; its outer
step's anchor and momentum are the same element range (:class:`FragmentOuter`).
``fragments=1`` is one fragment made of the buckets themselves.
"""

from __future__ import annotations

import torch

from localclip.averaging.buffers import BLOCK_NUMEL, FlatBucket

__all__ = ["BucketSlice", "Fragment", "FragmentOuter", "check", "offsets", "split"]

# How far past 1/P of the state's bytes a fragment may grow when its cuts are moved to a multiple
# of a block (the target is 1/P + 5 %; half of it is left for the round's weight and
# the rounding of a cut to a whole element).
BLOCK_SLACK = 0.025


def check(fragments, period: int, n_elements: int | None = None) -> None:
    """Refuse a fragment count that cannot be scheduled (or, given ``n_elements``, split into
    non-empty fragments): one line naming the values."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"Invalid fragments: {fragments!r} (must be an integer >= 1)")
    if fragments > period:
        raise ValueError(f"Invalid fragments={fragments} with period={period}: at most one fragment may start per step (fragments <= period)")
    if n_elements is not None and fragments > n_elements:
        raise ValueError(f"Invalid fragments={fragments}: the model has only {n_elements} averaged elements (a fragment holds at least one)")


def offsets(fragments: int, period: int) -> list[int]:
    """Fragment p's offset ``floor(p·period/fragments)``: its rounds follow steps o_p, o_p + period, …
    (fragment 0's offset 0 means steps period, 2·period, …, as without fragments)."""
    return [p * period // fragments for p in range(fragments)]


class BucketSlice(FlatBucket):
    """Elements ``[lo, hi)`` of a flat bucket: its values (or ``values``, another buffer of the
    bucket's shape: a round in flight sends a snapshot), anchor and send buffer, as views."""

    def __init__(self, bucket: FlatBucket, lo: int, hi: int, values: torch.Tensor | None = None):  # noqa: D107 - no FlatBucket.__init__: nothing is re-homed
        self.bucket, self.lo, self.hi = bucket, lo, hi
        self.values = (bucket.values if values is None else values)[lo:hi]
        self.anchor = None if bucket.anchor is None else bucket.anchor[lo:hi]
        self.wire = None if bucket.wire is None else bucket.wire[lo:hi]
        self.n_params = min(max(bucket.n_params - lo, 0), hi - lo)  # parameters first, then buffers


class Fragment:
    """One fragment: ``ranges`` holds, per bucket it touches, ``(bucket index, lo, hi)``;
    ``start, stop`` its elements in the buckets' concatenated order; ``names`` the tensors it
    holds all or part of; ``nbytes`` the bytes of its values."""

    def __init__(self, ranges: list[tuple[int, int, int]], start: int, stop: int, names: list[str], nbytes: int):
        self.ranges, self.start, self.stop, self.names, self.nbytes = ranges, start, stop, names, nbytes

    def slices(self, buckets: list[FlatBucket], values: list[torch.Tensor] | None = None) -> list[FlatBucket]:
        """The fragment's views of ``buckets`` (a whole bucket is itself), over ``values[i]`` instead
        of bucket i's values when given."""
        out = []
        for i, lo, hi in self.ranges:
            b = buckets[i]
            whole = lo == 0 and hi == b.values.numel()
            out.append(b if whole and values is None else BucketSlice(b, lo, hi, None if values is None else values[i]))
        return out

    def __repr__(self) -> str:
        return f"Fragment(elements [{self.start}, {self.stop}), {self.nbytes} bytes)"


def split(names: list[list[str]], buckets: list[FlatBucket], fragments: int) -> list[Fragment]:
    """Cut the buckets' elements, in order, into ``fragments`` contiguous ranges of about equal
    bytes (the bytes a round puts in flight); checked by :func:`check` first.

    Cut k lies at k/P of the state's bytes, moved to the nearest multiple of ``grain`` elements
    in its bucket: ``grain`` is the largest power of two up to the round's block
    (:data:`~localclip.averaging.buffers.BLOCK_NUMEL`) whose bytes are at most
    :data:`BLOCK_SLACK` of 1/P of the state, so that a fragment's blocks are the round's blocks
    where the model is large enough and no fragment exceeds 1/P by more than that slack (or,
    where the grain is one element, by more than one element).
    """
    sizes = [b.values.element_size() for b in buckets]
    numels = [b.values.numel() for b in buckets]
    total, n = sum(k * s for k, s in zip(numels, sizes)), sum(numels)
    grain = BLOCK_NUMEL
    while grain > 1 and grain * max(sizes) * fragments > BLOCK_SLACK * total:
        grain //= 2
    cuts = [0]
    for k in range(1, fragments):
        target = k * total // fragments  # bytes before cut k
        first, before = 0, 0  # the bucket's first element, the bytes before it
        for numel, size in zip(numels, sizes):
            if target <= before + numel * size:
                step = grain * size  # bytes of one grain: the cut goes to the nearest multiple
                at = min(numel, (target - before + step // 2) // step * grain)
                break
            first, before = first + numel, before + numel * size
        # No fragment is empty (only a model with about as few elements as fragments needs it).
        cuts.append(min(max(first + at, cuts[-1] + 1), n - (fragments - k)))
    cuts.append(n)
    bounds, at = [], 0  # each bucket's [first, last) element in the concatenated order
    for numel in numels:
        bounds.append((at, at + numel))
        at += numel
    out = []
    for start, stop in zip(cuts, cuts[1:]):
        ranges, held = [], []
        for i, (first, last) in enumerate(bounds):
            lo, hi = max(start, first), min(stop, last)
            if lo >= hi:
                continue
            ranges.append((i, lo - first, hi - first))
            offset = first
            for name, view in zip(names[i], buckets[i].views):
                if offset < hi and offset + view.numel() > lo:
                    held.append(name)
                offset += view.numel()
        nbytes = sum((hi - lo) * sizes[i] for i, lo, hi in ranges)
        out.append(Fragment(ranges, start, stop, held, nbytes))
    return out


class FragmentOuter:
    """One fragment's view of the blockwise outer step: the :class:`~localclip.averaging.outer.OuterSGD` is
    bound to every fragment's parameter anchors in order (one per bucket slice, so a tensor cut
    between two fragments has its momentum cut at the same element), and this fragment's first
    one is ``base``; its momentum, like its anchor, is the fragment's own element range."""

    blockwise = True

    def __init__(self, outer, base: int):
        self.outer, self.base = outer, base

    def apply(self, index: int, start: int, average: torch.Tensor, anchor: torch.Tensor) -> None:
        self.outer.apply(self.base + index, start, average, anchor)
