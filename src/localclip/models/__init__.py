"""The models of the paper's experiments, and a registry that builds them by name.

Language models (sequence-first, returning :class:`LMOutput`): :class:`AWDLSTM` for PTB and
WikiText-2, :class:`LSTMLM` for fast CPU runs, :class:`GPT` (a small decoder-only transformer). Image models: :func:`resnet` (CIFAR-style
ResNets with BatchNorm). Recipes name a model with a string and :func:`build_model` builds it,
so configs stay plain data.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from localclip.errors import ConfigError
from localclip.models.awd_lstm import AWDLSTM, WeightDropLSTM
from localclip.models.gpt import GPT, GPTConfig
from localclip.models.lm import LMOutput, ar_tar_penalty, detach_hidden
from localclip.models.lstm import LSTMLM
from localclip.models.resnet import RESNET_DEPTHS, resnet

__all__ = [
    "AWDLSTM",
    "GPT",
    "GPTConfig",
    "LSTMLM",
    "LMOutput",
    "MODELS",
    "RESNET_DEPTHS",
    "WeightDropLSTM",
    "ar_tar_penalty",
    "build_model",
    "detach_hidden",
    "resnet",
]


def _resnet_of_depth(depth: int) -> Callable[..., nn.Module]:
    def build(**kwargs: Any) -> nn.Module:
        return resnet(depth, **kwargs)

    build.__doc__ = f"ResNet-{depth}; keyword arguments as :func:`resnet`."
    return build


#: Model names accepted by :func:`build_model`, each mapped to its constructor.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "awd_lstm": AWDLSTM,
    "gpt": GPT,
    "lstm": LSTMLM,
    "resnet": resnet,
    **{f"resnet{d}": _resnet_of_depth(d) for d in RESNET_DEPTHS},
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` (see :data:`MODELS`) with ``kwargs``.

    ``build_model("awd_lstm", ntoken=10000)``, ``build_model("resnet32", in_channels=1)``.
    """
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(f"Unknown model {name!r} (choose one of {sorted(MODELS)})") from None
    return factory(**kwargs)
