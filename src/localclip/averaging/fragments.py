"""Streaming fragments: the averaged state split into P parts that sync on staggered schedules.

With ``fragments=P`` (Streaming DiLoCo, Douillard et al., 2025) the averaged tensors are split
into P *fragments* of about equal bytes: whole tensors, contiguous in model order (bucket by
bucket; in a bucket, the parameters in the module's order, then the floating-point buffers).
Fragment p takes its round after the steps t with ``(t − o_p) mod period == 0``, t ≥ o_p, where
``o_p = floor(p·period/P)`` (:func:`offsets`): every period still syncs each fragment once, and
each round sends about 1/P of the model. P must be at most the period (so that no two fragments
share an offset) and at most the number of tensors (a tensor is never cut).

The split minimises the largest fragment's bytes (:func:`split`); a fragment is one
:class:`BucketSlice` per flat bucket it touches, a view of the bucket's values, anchor and send
buffer over its tensors' elements, so that a :class:`~localclip.averaging.round.Round` runs on a
fragment as on whole buckets. ``fragments=1`` is one fragment made of the buckets themselves.
"""

from __future__ import annotations

import torch

from localclip.averaging.buffers import FlatBucket

__all__ = ["BucketSlice", "Fragment", "FragmentOuter", "check", "count_tensors", "offsets", "split"]


def check(fragments, period: int, n_tensors: int | None = None) -> None:
    """Refuse a fragment count that cannot be scheduled (or, given ``n_tensors``, split): one
    line naming the values."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"Invalid fragments: {fragments!r} (must be an integer >= 1)")
    if fragments > period:
        raise ValueError(f"Invalid fragments={fragments} with period={period}: at most one fragment may start per step (fragments <= period)")
    if n_tensors is not None and fragments > n_tensors:
        raise ValueError(f"Invalid fragments={fragments}: the model has only {n_tensors} averaged tensors (a fragment holds whole tensors)")


def count_tensors(module, average_buffers: bool = True) -> int:
    """How many tensors an averager over ``module`` averages (what :func:`check` compares P
    with): trainable parameters and, with ``average_buffers``, floating-point buffers, each once.
    Works on a model built on the ``meta`` device, so a config is checked without building it."""
    seen = {id(p) for p in module.parameters() if p.requires_grad}
    if average_buffers:
        seen |= {id(b) for b in module.buffers() if b.is_floating_point()}
    return len(seen)


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
    ``names`` its tensors' names, ``nbytes`` the bytes of its values."""

    def __init__(self, ranges: list[tuple[int, int, int]], names: list[str], nbytes: int):
        self.ranges, self.names, self.nbytes = ranges, names, nbytes

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
        return f"Fragment({len(self.names)} tensors, {self.nbytes} bytes)"


def split(names: list[list[str]], buckets: list[FlatBucket], fragments: int) -> list[Fragment]:
    """Split the buckets' tensors into ``fragments`` contiguous groups of whole tensors, minimising
    the largest group's bytes (the bytes a round puts in flight); checked by :func:`check` first."""
    tensors = []  # (bucket index, lo, hi, name, bytes), in model order
    for i, (bucket_names, b) in enumerate(zip(names, buckets)):
        offset = 0
        for name, view in zip(bucket_names, b.views):
            n = view.numel()
            tensors.append((i, offset, offset + n, name, n * view.element_size()))
            offset += n
    sizes = [t[4] for t in tensors]
    groups = _partition(sizes, fragments)
    out = []
    for group in groups:
        ranges: list[tuple[int, int, int]] = []
        for k in group:
            i, lo, hi = tensors[k][:3]
            if ranges and ranges[-1][0] == i and ranges[-1][2] == lo:
                ranges[-1] = (i, ranges[-1][1], hi)
            else:
                ranges.append((i, lo, hi))
        out.append(Fragment(ranges, [tensors[k][3] for k in group], sum(sizes[k] for k in group)))
    return out


def _partition(sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous groups of indices, exactly ``parts`` of them, none empty, the largest sum minimal."""

    def greedy(cap: int) -> list[list[int]]:
        groups, total = [[]], 0
        for k, s in enumerate(sizes):
            if groups[-1] and total + s > cap:
                groups.append([])
                total = 0
            groups[-1].append(k)
            total += s
        return groups

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the least cap that `parts` groups can meet
        cap = (lo + hi) // 2
        if len(greedy(cap)) <= parts:
            hi = cap
        else:
            lo = cap + 1
    groups = greedy(lo)
    while len(groups) < parts:
        # Too few groups (the cap is met with fewer): split the largest that has two tensors or
        # more where its halves are closest; the largest sum does not grow.
        k = max((g for g in groups if len(g) > 1), key=lambda g: sum(sizes[i] for i in g))
        at = min(range(1, len(k)), key=lambda c: abs(sum(sizes[i] for i in k[:c]) - sum(sizes[i] for i in k[c:])))
        j = groups.index(k)
        groups[j : j + 1] = [k[:at], k[at:]]
    return groups


class FragmentOuter:
    """One fragment's view of the blockwise outer step: the :class:`~localclip.outer.OuterSGD` is
    bound to every fragment's parameter anchors in order, and this fragment's first one is
    ``base``; its momentum, like its anchor, is the fragment's own."""

    blockwise = True

    def __init__(self, outer, base: int):
        self.outer, self.base = outer, base

    def apply(self, index: int, start: int, average: torch.Tensor, anchor: torch.Tensor) -> None:
        self.outer.apply(self.base + index, start, average, anchor)
