"""A small LSTM language model on ``nn.LSTM``: the fast CPU model of the ``ptb-small`` recipe.

This module owns :class:`LSTMLM`, the "medium" model of Zaremba et al. (2014) and of PyTorch's
word_language_model example: embedding, stacked ``nn.LSTM``, linear decoder, plain dropout on
the non-recurrent connections. It shares :class:`~localclip.models.lm.LMOutput` and the
``init_hidden`` / ``detach_hidden`` interface with :class:`~localclip.models.awd_lstm.AWDLSTM`,
so the training loop does not care which one it gets.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from localclip.errors import ConfigError
from localclip.models.lm import LMOutput, check_positive, check_probability

__all__ = ["LSTMLM"]


class LSTMLM(nn.Module):
    """Embedding -> ``nn.LSTM(num_layers)`` -> decoder, sequence-first.

    ``dropout`` applies to the embedding output, between LSTM layers (``nn.LSTM``'s own
    inter-layer dropout, as in Zaremba et al.) and to the LSTM output. ``raw_output`` and
    ``output`` of the returned :class:`LMOutput` are the LSTM output before and after that last
    dropout. With ``tie_weights`` the decoder reuses the embedding matrix, which needs
    ``emb_size == hidden_size``.

    Init: embedding (and an untied decoder weight) uniform(-0.1, 0.1), decoder bias 0,
    ``nn.LSTM``'s default.
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

        self.encoder = nn.Embedding(ntoken, emb_size)
        # nn.LSTM warns about inter-layer dropout when there is no second layer.
        inter_layer = dropout if num_layers > 1 else 0.0
        self.rnn = nn.LSTM(emb_size, hidden_size, num_layers, dropout=inter_layer)
        self.decoder = nn.Linear(hidden_size, ntoken)
        self.reset_parameters()
        if tie_weights:
            self.decoder.weight = self.encoder.weight

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        if not self.tie_weights:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.rnn.reset_parameters()

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
        x = F.dropout(self.encoder(tokens), self.dropout, self.training)
        raw_output, new_hidden = self.rnn(x, hidden)
        output = F.dropout(raw_output, self.dropout, self.training)
        return LMOutput(self.decoder(output), new_hidden, raw_output, output)
