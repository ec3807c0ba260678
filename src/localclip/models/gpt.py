"""A small decoder-only transformer (GPT) for word-level language modelling.

This module owns :class:`GPT` and its :class:`GPTConfig`, written after nanoGPT's ``model.py``:
token and position embeddings, ``n_layer`` pre-LayerNorm :class:`Block` s (causal
self-attention through ``F.scaled_dot_product_attention``, then an MLP), a final LayerNorm and a
decoder tied to the token embedding.

It speaks the language-model contract of :mod:`localclip.models.lm` so that the LM workload
trains it like the LSTMs: tokens are sequence-first ``[T, B]``, ``forward(tokens, hidden)``
returns an :class:`~localclip.models.lm.LMOutput` with ``[T, B, ntoken]`` logits. A transformer
carries no state from one window to the next, so :meth:`GPT.init_hidden` returns ``None`` and so
does ``LMOutput.hidden``; every BPTT window is an independent context of at most ``block_size``
tokens.

Dropout masks are drawn from the model's ``generator`` attribute (``None``: torch's default
generator), which the trainer sets to the worker's own generator. That is why dropout here is
:func:`localclip.models.lm.dropout` rather than ``nn.Dropout``, ``F.dropout`` or SDPA's
``dropout_p``: none of them accepts a generator. Attention dropout (off by default) therefore computes the attention
weights explicitly; without it attention goes through the fused SDPA kernel.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from localclip.errors import ConfigError
from localclip.models.lm import LMOutput, check_positive, check_probability, dropout

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "check_windows"]


@dataclass
class GPTConfig:
    """The shape of a :class:`GPT`."""

    ntoken: int
    """Vocabulary size."""
    block_size: int = 128
    """The longest context (and the number of learned positions)."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    """Width of the residual stream; must be divisible by ``n_head``."""
    dropout: float = 0.1
    """Dropout on the embeddings and on each residual branch's output."""
    attn_dropout: float = 0.0
    """Dropout on the attention weights (needs the explicit, slower attention path)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms."""

    def validate(self) -> "GPTConfig":
        for name in ("ntoken", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive(name, getattr(self, name))
        check_probability("dropout", self.dropout)
        check_probability("attn_dropout", self.attn_dropout)
        if self.n_embd % self.n_head:
            raise ConfigError(f"Invalid GPT sizes: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        return self


def check_windows(block_size: int, *, variable: bool = False, **lengths: int | None) -> None:
    """Reject training or evaluation windows longer than the model's context, naming them.

    ``check_windows(64, bptt=70, eval_bptt=None)`` raises: a window of 70 tokens cannot be fed to
    a model with 64 positions. ``variable=True`` (AWD-LSTM's random BPTT lengths, which have no
    upper bound) is rejected outright.
    """
    if variable:
        raise ConfigError(f"Invalid variable_bptt=True for the GPT: its window lengths are unbounded, the model's context is {block_size} tokens")
    for name, length in lengths.items():
        if length is not None and length > block_size:
            raise ConfigError(
                f"Invalid {name}: {length} tokens per window exceed the GPT's context "
                f"(model_options.block_size={block_size}); lower {name} or raise block_size"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on batch-first ``[B, T, C]`` activations."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.attn_dropout = config.attn_dropout
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.training and self.attn_dropout > 0:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            weights = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            y = dropout(weights, self.attn_dropout, True, generator) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return dropout(self.c_proj(y), self.dropout, self.training, generator)


class MLP(nn.Module):
    """The position-wise feed-forward branch: ``n_embd -> 4·n_embd -> GELU -> n_embd``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.dropout = config.dropout
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training, generator)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Normalising the branch inputs rather than the sum keeps the residual stream an identity path
    from the embeddings to the output, which is what lets a transformer train without warmup
    tricks at these sizes.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``generator``: where this block's dropout masks come from (None: torch's default)."""
        x = x + self.attn(self.ln_1(x), generator)
        return x + self.mlp(self.ln_2(x), generator)


class GPT(nn.Module):
    """Decoder-only transformer language model, sequence-first (see the module docstring).

    Build it from keyword arguments (``GPT(ntoken=10000, n_layer=2, n_embd=128)``) or a
    :class:`GPTConfig` (``GPT(config=cfg)``).

    Init (as GPT-2 and nanoGPT): every linear and embedding weight normal(0, 0.02), biases zero,
    LayerNorms at identity. The output projection of each residual branch (``c_proj``) is
    scaled down further, to std 0.02/sqrt(2·n_layer): the residual stream is a sum of
    2·n_layer branch outputs, so this keeps its variance at initialisation independent of depth.
    The decoder shares the token embedding's matrix (weight tying), which at these vocabulary
    sizes is most of the parameters.
    """

    def __init__(self, ntoken: int | None = None, *, config: GPTConfig | None = None, **options) -> None:
        super().__init__()
        if config is None:
            if ntoken is None:
                raise ConfigError("GPT needs ntoken (the vocabulary size) or a GPTConfig")
            try:
                config = GPTConfig(ntoken=ntoken, **options)
            except TypeError as exc:
                raise ConfigError(f"Invalid GPT option: {exc}") from None
        elif ntoken is not None or options:
            raise ConfigError("GPT takes either a GPTConfig or keyword options, not both")
        self.config = config.validate()
        self.ntoken = config.ntoken
        self.block_size = config.block_size
        #: Where dropout masks come from; None is torch's default generator.
        self.generator: torch.Generator | None = None
        self.wte = nn.Embedding(config.ntoken, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.ntoken, bias=False)
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def init_hidden(self, batch_size: int) -> None:
        """No recurrent state: each window is its own context."""
        return None

    def forward(self, tokens: Tensor, hidden: None = None) -> LMOutput:
        """``tokens``: ``[T, B]`` int64 with ``T <= block_size``; ``hidden`` is ignored (None)."""
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects tokens of shape [T, B], got {tuple(tokens.shape)}")
        T = tokens.size(0)
        if T > self.block_size:
            raise ConfigError(f"GPT context too long: {T} tokens, but block_size is {self.block_size} (lower bptt/eval_bptt or raise model_options.block_size)")
        idx = tokens.t()  # [B, T]: attention mixes along T
        pos = torch.arange(T, device=tokens.device)
        x = dropout(self.wte(idx) + self.wpe(pos), self.config.dropout, self.training, self.generator)
        for block in self.blocks:
            x = block(x, self.generator)
        x = self.ln_f(x)
        out = x.transpose(0, 1)  # back to sequence-first [T, B, C]
        return LMOutput(self.lm_head(out), None, out, out)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.config).items())
