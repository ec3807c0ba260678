"""What every word-level language model in `localclip` shares.

This module owns the output contract (:class:`LMOutput`), the AR/TAR activation penalty of the
AWD-LSTM recipe (:func:`ar_tar_penalty`), hidden-state repackaging for truncated BPTT
(:func:`detach_hidden`), and the two dropout forms that act on whole rows rather than single
units (:func:`embedding_dropout`, :func:`locked_dropout`).

Tensors are sequence-first: tokens ``[T, B]``, activations ``[T, B, H]``, logits
``[T, B, ntoken]``. Every random mask is drawn from the ``generator`` passed in (the model's own,
see :mod:`localclip.rng`; ``None`` means torch's default generator), in a fixed order, so a
forward pass is reproducible from that generator's seed alone, whatever other threads do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from localclip.errors import ConfigError

__all__ = [
    "LMOutput",
    "ar_tar_penalty",
    "detach_hidden",
    "dropout",
    "dropout_mask",
    "embedding_dropout",
    "locked_dropout",
]


class LMOutput(NamedTuple):
    """What a language model's ``forward(tokens, hidden)`` returns.

    Attributes:
        logits: ``[T, B, ntoken]`` unnormalised next-token scores.
        hidden: the recurrent state after the last step, in the model's own structure; feed it
            (after :func:`detach_hidden`) to the next call.
        raw_output: ``[T, B, H]`` the last recurrent layer's output before the final dropout
            (TAR penalises its changes over time).
        output: ``[T, B, H]`` the same after the final dropout, i.e. the decoder's input
            (AR penalises its magnitude).
    """

    logits: Tensor
    hidden: Any
    raw_output: Tensor
    output: Tensor


def ar_tar_penalty(out: LMOutput, alpha: float, beta: float) -> Tensor:
    """Activation (AR) and temporal activation (TAR) regularisation of Merity et al. (2018).

    ``alpha * mean(output**2) + beta * mean((raw_output[1:] - raw_output[:-1])**2)``, a 0-dim
    tensor to add to the cross-entropy before ``backward``. The reported loss is the
    cross-entropy alone, so callers keep the two apart.
    """
    if alpha < 0 or beta < 0:
        raise ConfigError(f"Invalid AR/TAR weights: alpha={alpha}, beta={beta} (need >= 0)")
    penalty = out.output.new_zeros(())
    # Skipping a zero-weighted term saves a pass over [T, B, H] in every training step.
    if alpha:
        penalty = penalty + alpha * out.output.pow(2).mean()
    # A single-step sequence has no temporal difference; its mean would be NaN.
    if beta and out.raw_output.size(0) > 1:
        diff = out.raw_output[1:] - out.raw_output[:-1]
        penalty = penalty + beta * diff.pow(2).mean()
    return penalty


def detach_hidden(hidden: Any) -> Any:
    """Cut the autograd history of a hidden state (truncated BPTT), keeping its structure.

    Accepts a tensor or any nesting of tuples and lists of tensors, so one helper serves
    ``nn.LSTM``'s ``(h, c)`` pair and the AWD-LSTM's list of per-layer pairs; ``None`` (a
    model without recurrent state, such as the GPT) stays ``None``.
    """
    if hidden is None:
        return None
    if isinstance(hidden, Tensor):
        return hidden.detach()
    if isinstance(hidden, (tuple, list)):
        return type(hidden)(detach_hidden(h) for h in hidden)
    raise TypeError(f"detach_hidden expects tensors in tuples/lists, got {type(hidden).__name__}")


def dropout_mask(like: Tensor, shape: tuple[int, ...], p: float, generator: torch.Generator | None = None) -> Tensor:
    """A ``shape`` mask of 0 (probability p) and 1/(1-p), with ``like``'s dtype and device.

    Thresholding ``torch.rand`` is about 2.5x faster on CPU than ``bernoulli_`` (what
    ``F.dropout`` uses), which matters for weight drop: three fresh masks over 12M weights every
    step of the PTB model. It also takes a generator, which ``F.dropout`` does not.
    """
    keep = torch.rand(shape, dtype=like.dtype, device=like.device, generator=generator) >= p
    return keep.to(like.dtype).div_(1 - p)


def dropout(x: Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> Tensor:
    """Elementwise dropout (``F.dropout``'s semantics) with masks from ``generator``."""
    if not training or p == 0:
        return x
    return x * dropout_mask(x, x.shape, p, generator)


def embedding_dropout(weight: Tensor, tokens: Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> Tensor:
    """Look up ``tokens`` in ``weight`` with whole vocabulary rows dropped with probability p.

    A dropped word is zero everywhere it occurs in the batch; kept rows are scaled by 1/(1-p).
    The mask covers the whole vocabulary (one draw of ``ntoken`` values per call) but is
    applied after the lookup: gathering mask entries per token equals masking the matrix, in
    value and in gradient, without materialising a dropped copy of the ``[ntoken, E]`` matrix.
    """
    emb = F.embedding(tokens, weight)
    if not training or p == 0:
        return emb
    mask = dropout_mask(weight, (weight.size(0), 1), p, generator)
    return emb * F.embedding(tokens, mask)


def locked_dropout(x: Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> Tensor:
    """Variational dropout of Gal & Ghahramani (2016) on ``[T, B, H]``: one mask per sequence.

    The same units are dropped at every time step, which is what makes dropout usable on
    recurrent activations.
    """
    if not training or p == 0:
        return x
    return x * dropout_mask(x, (1, x.size(1), x.size(2)), p, generator)


def check_probability(name: str, p: float) -> None:
    """Reject dropout rates outside [0, 1); 1 would divide by zero in the rescaling."""
    if not 0 <= p < 1:
        raise ConfigError(f"Invalid {name}: {p} (need 0 <= {name} < 1)")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"Invalid {name}: {value!r} (need a positive integer)")
