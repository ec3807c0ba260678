"""The flat buffers: where the averaged tensors live, so that a round is one pass and one collective.

The averaged tensors (trainable parameters and, optionally, floating-point buffers such as
BatchNorm statistics) are moved, once, into one persistent flat buffer per (device, dtype): each
parameter's ``.data`` and each buffer becomes a view into it. Parameters come first in a buffer,
buffers after them, so that the outer step (parameters only) and naive parallel clipping's
buffer-only round each take one slice. A :class:`FlatBucket` may also hold an *anchor* (the values
as of the last round, for compression and outer steps) and a low-precision send buffer.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BLOCK_NUMEL", "FlatBucket", "check_views", "flatten"]

# Elements per block of the passes after the transport: 1 MiB of float32 stays in L2 between the
# several element-wise operations of decoding and the outer step.
BLOCK_NUMEL = 1 << 18


class _FlatBucket:
    """A flat buffer of one device and dtype whose slices back the averaged tensors.

    The first ``n_params`` elements back trainable parameters, the rest floating-point buffers.
    """

    def __init__(self, tensors: list[torch.Tensor], bind: list, n_params: int):
        numel = sum(t.numel() for t in tensors)
        self.values = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
        self.n_params = n_params
        self.anchor: torch.Tensor | None = None  # the values as of the last round
        self.wire: torch.Tensor | None = None  # the low-precision send buffer (compression)
        offset = 0
        self.views = []
        for t, rebind in zip(tensors, bind):
            view = self.values[offset : offset + t.numel()].view_as(t)
            view.copy_(t)
            rebind(view)
            self.views.append(view)
            offset += t.numel()

    @property
    def sent(self) -> torch.Tensor:
        return self.values if self.wire is None else self.wire

    def ranges(self, chunk_numel: int | None) -> list[tuple[int, int]]:
        n = self.values.numel()
        step = n if chunk_numel is None else max(1, chunk_numel)
        return [(s, min(n, s + step)) for s in range(0, n, step)]


def flatten(module: nn.Module, average_buffers: bool) -> tuple[list[list[str]], list[FlatBucket]]:
    """Re-home ``module``'s trainable parameters (and floating-point buffers) into flat buckets;
    returns the tensors' names per bucket and the buckets."""
    entries = []  # (name, tensor, rebind)
    seen = set()
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            entries.append((name, p, lambda v, p=p: setattr(p, "data", v), p))
    if average_buffers:
        for mod_name, mod in module.named_modules():
            for buf_name, buf in mod._buffers.items():
                if buf is None or not buf.is_floating_point() or id(buf) in seen:
                    continue
                seen.add(id(buf))
                name = f"{mod_name}.{buf_name}" if mod_name else buf_name

                def rebind(v, mod=mod, buf_name=buf_name):
                    mod._buffers[buf_name] = v

                entries.append((name, buf, rebind, (mod, buf_name)))
    by_key: dict[tuple, list] = {}
    for entry in entries:
        t = entry[1]
        by_key.setdefault((t.device, t.dtype), []).append(entry)
    names, buckets = [], []
    for group in by_key.values():
        # Parameters first: the outer step and naive's buffer-only round use the two halves.
        group.sort(key=lambda e: not isinstance(e[3], torch.Tensor))
        n_params = sum(e[3].numel() for e in group if isinstance(e[3], torch.Tensor))
        bucket = _FlatBucket([e[1].detach() for e in group], [e[2] for e in group], n_params)
        bucket.owners = [e[3] for e in group]
        names.append([e[0] for e in group])
        buckets.append(bucket)
    return names, buckets


FlatBucket = _FlatBucket  # the name the other modules use; tools that inspect the averager's memory know the class by its own


def check_views(names: list[list[str]], buckets: list[FlatBucket]) -> None:
    """Fail loudly if someone replaced a tensor the flat buffers back."""
    for bucket_names, bucket in zip(names, buckets):
        for name, owner, view in zip(bucket_names, bucket.owners, bucket.views):
            live = owner if isinstance(owner, torch.Tensor) else owner[0]._buffers[owner[1]]
            if live.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    f"tensor {name!r} was re-assigned after the PeriodicAverager was created; "
                    "create the averager after moving or replacing the module's tensors"
                )
