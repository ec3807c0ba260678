"""A small LSTM language model on ``nn.LSTM``: the fast CPU model of the ``ptb-small`` recipe.

This module owns :class:`LSTMLM`, the "medium" model of Zaremba et al. (2014) and of PyTorch's
word_language_model example: embedding, stacked LSTM layers, linear decoder, plain dropout on
the non-recurrent connections. It shares :class:`~localclip.models.lm.LMOutput` and the
``init_hidden`` / ``detach_hidden`` interface with :class:`~localclip.models.awd_lstm.AWDLSTM`,
so the training loop does not care which one it gets.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from localclip.errors import ConfigError
from localclip.models.lm import LMOutput, check_positive, check_probability, dropout

__all__ = ["LSTMLM"]


class LSTMLM(nn.Module):
    """Embedding -> ``num_layers`` single-layer ``nn.LSTM`` -> decoder, sequence-first.

    ``dropout`` applies to the embedding output, between LSTM layers (as in Zaremba et al.) and
    to the LSTM output, with masks from ``self.generator`` (``None``: torch's default). The
    layers are separate ``nn.LSTM`` modules because ``nn.LSTM``'s own inter-layer dropout
    draws from the default generator and takes no other. ``raw_output`` and
    ``output`` of the returned :class:`LMOutput` are the LSTM output before and after that last
    dropout. With ``tie_weights`` the decoder reuses the embedding matrix, which needs
    ``emb_size == hidden_size``.

    Init: embedding (and an untied decoder weight) uniform(-0.1, 0.1), decoder bias 0,
    ``nn.LSTM``'s default (the same draws as one ``nn.LSTM(num_layers)`` would make).
    """

    def __init__(
        self,
        ntoken: int,
        *,
        emb_size: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        dropout: float = 0.2,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        for name, value in [
            ("ntoken", ntoken),
            ("emb_size", emb_size),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
        ]:
            check_positive(name, value)
        check_probability("dropout", dropout)
        if tie_weights and emb_size != hidden_size:
            raise ConfigError(
                f"Invalid LSTMLM sizes: tie_weights needs emb_size == hidden_size, "
                f"got emb_size={emb_size}, hidden_size={hidden_size}"
            )
        self.ntoken = ntoken
        self.emb_size = emb_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout = dropout
        self.tie_weights = tie_weights
        self.generator: torch.Generator | None = None

        self.encoder = nn.Embedding(ntoken, emb_size)
        self.rnns = nn.ModuleList(
            nn.LSTM(emb_size if l == 0 else hidden_size, hidden_size) for l in range(num_layers)
        )
        self.decoder = nn.Linear(hidden_size, ntoken)
        self.reset_parameters()
        if tie_weights:
            self.decoder.weight = self.encoder.weight

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        if not self.tie_weights:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        for rnn in self.rnns:
            rnn.reset_parameters()

    def init_hidden(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """Zero state ``(h, c)``, each ``[num_layers, batch_size, hidden_size]``."""
        w = self.encoder.weight
        shape = (self.num_layers, batch_size, self.hidden_size)
        return w.new_zeros(shape), w.new_zeros(shape)

    def forward(self, tokens: Tensor, hidden: tuple[Tensor, Tensor] | None = None) -> LMOutput:
        """``tokens``: ``[T, B]`` int64; ``hidden``: from :meth:`init_hidden` or a previous call
        (zeros when None)."""
        if tokens.dim() != 2:
            raise ValueError(f"LSTMLM expects tokens of shape [T, B], got {tuple(tokens.shape)}")
        if hidden is None:
            hidden = self.init_hidden(tokens.size(1))
        p, training, g = self.dropout, self.training, self.generator
        h0, c0 = hidden
        x = dropout(self.encoder(tokens), p, training, g)
        hs, cs = [], []
        for l, rnn in enumerate(self.rnns):
            if l > 0:
                x = dropout(x, p, training, g)
            x, (h, c) = rnn(x, (h0[l : l + 1], c0[l : l + 1]))
            hs.append(h)
            cs.append(c)
        raw_output = x
        output = dropout(raw_output, p, training, g)
        new_hidden = (torch.cat(hs), torch.cat(cs)) if len(hs) > 1 else (hs[0], cs[0])
        return LMOutput(self.decoder(output), new_hidden, raw_output, output)
