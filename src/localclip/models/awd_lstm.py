"""The AWD-LSTM language model (Merity, Keskar, Socher 2018), written from its description.

This module owns :class:`WeightDropLSTM` (one LSTM layer with DropConnect on its
hidden-to-hidden matrix) and :class:`AWDLSTM` (embedding, three such layers, tied decoder, and
the embedding / input / hidden / output dropouts), as used for PTB and WikiText-2 in
docs/algorithm.md §4.

Weight drop is computed in ``forward`` from the one ``weight_hh`` parameter each call. Nothing is
cached and no parameter is re-registered, so each trainable tensor appears once in
``parameters()``, and ``deepcopy``, ``state_dict`` and an optimizer or averager that later
points ``param.data`` into its own flat buffer all see the live weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from localclip.models.lm import (
    LMOutput,
    check_positive,
    check_probability,
    dropout_mask,
    embedding_dropout,
    locked_dropout,
)

__all__ = ["AWDLSTM", "WeightDropLSTM"]

LayerHidden = tuple[Tensor, Tensor]


class WeightDropLSTM(nn.Module):
    """A single-layer LSTM over ``[T, B, input_size]`` with DropConnect on ``weight_hh``.

    Parameters carry ``nn.LSTM``'s names, shapes, gate order (i, f, g, o) and init
    (uniform(-1/sqrt(h), 1/sqrt(h)) for weights and biases), so weights can be copied to and
    from an ``nn.LSTM`` layer. In training mode each call draws one elementwise mask over
    ``weight_hh`` (kept entries scaled by 1/(1-p)), shared by all time steps and sequences of
    the batch; in eval mode the raw matrix is used.
    """

    def __init__(self, input_size: int, hidden_size: int, weight_drop: float = 0.0) -> None:
        super().__init__()
        check_positive("input_size", input_size)
        check_positive("hidden_size", hidden_size)
        check_probability("weight_drop", weight_drop)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_drop = weight_drop
        self.generator: torch.Generator | None = None  # where the weight-drop mask comes from
        gates = 4 * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gates, input_size))
        self.weight_hh = nn.Parameter(torch.empty(gates, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(gates))
        self.bias_hh = nn.Parameter(torch.empty(gates))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: Tensor, hx: LayerHidden) -> tuple[Tensor, LayerHidden]:
        """Run the layer; ``hx`` is ``(h, c)``, each ``[1, B, hidden_size]``."""
        w_hh = self.weight_hh
        if self.training and self.weight_drop:
            w_hh = w_hh * dropout_mask(w_hh, w_hh.shape, self.weight_drop, self.generator)
        weights = _kernel_weights(self.weight_ih, w_hh, self.bias_ih, self.bias_hh)
        # The fused ATen kernel behind nn.LSTM (oneDNN on CPU), fed our dropped matrix: about
        # 4x faster than a Python loop over time steps (forward+backward, T=70, B=3, H=1150).
        # Arguments: has_biases, num_layers, dropout, train, bidirectional, batch_first.
        out, h, c = torch._VF.lstm(x, hx, weights, True, 1, 0.0, self.training, False, False)
        return out, (h, c)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, weight_drop={self.weight_drop}"


def _kernel_weights(w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor) -> list[Tensor]:
    if w_ih.is_cuda and torch.backends.cudnn.enabled:
        # cuDNN wants one contiguous weight buffer; handed separate tensors it compacts them
        # itself and warns on every call. The dropped w_hh is a fresh tensor anyway, so build
        # the buffer here (one extra copy of w_ih and the biases) and pass views into it.
        # Not exercised by the CPU test suite.
        shapes = [w.shape for w in (w_ih, w_hh, b_ih, b_hh)]
        flat = torch.cat([w_ih.reshape(-1), w_hh.reshape(-1), b_ih, b_hh])
        chunks = flat.split([s.numel() for s in shapes])
        return [chunk.view(s) for chunk, s in zip(chunks, shapes)]
    return [w_ih, w_hh, b_ih, b_hh]


class AWDLSTM(nn.Module):
    """AWD-LSTM: embedding, ``num_layers`` weight-dropped LSTMs, linear decoder.

    Layer ``l`` maps ``emb_size`` (l = 0) or ``hidden_size`` inputs to ``hidden_size`` outputs,
    except the last layer, which outputs ``emb_size`` when ``tie_weights`` so the decoder can
    share the embedding matrix (``decoder.weight is encoder.weight``; it is counted once in
    ``parameters()`` but, as in any tied PyTorch model, appears under both keys of
    ``state_dict``).

    Regularisation (training mode only; ``eval()`` turns all of it off):

    - ``dropout_e``: embedding dropout, whole words of the vocabulary;
    - ``dropout_i``: locked dropout on the embedded input;
    - ``dropout_h``: locked dropout between LSTM layers;
    - ``dropout``: locked dropout on the last layer's output, before the decoder;
    - ``weight_drop``: DropConnect on every layer's hidden-to-hidden matrix.

    Masks are drawn from ``self.generator`` (each layer's own ``generator`` for weight drop;
    :func:`localclip.rng.set_generator` sets them all) in that order (embedding, input, then per layer
    weight drop and hidden dropout, then output). Defaults are the PTB model of docs/algorithm.md §4
    (24.2M parameters for ``ntoken=10000``). Init: embedding (and an untied decoder weight)
    uniform(-0.1, 0.1), decoder bias 0, LSTM as in :class:`WeightDropLSTM`.
    """

    def __init__(
        self,
        ntoken: int,
        *,
        emb_size: int = 400,
        hidden_size: int = 1150,
        num_layers: int = 3,
        dropout: float = 0.4,
        dropout_h: float = 0.25,
        dropout_i: float = 0.4,
        dropout_e: float = 0.1,
        weight_drop: float = 0.5,
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
        for name, value in [
            ("dropout", dropout),
            ("dropout_h", dropout_h),
            ("dropout_i", dropout_i),
            ("dropout_e", dropout_e),
        ]:
            check_probability(name, value)
        self.ntoken = ntoken
        self.emb_size = emb_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout = dropout
        self.dropout_h = dropout_h
        self.dropout_i = dropout_i
        self.dropout_e = dropout_e
        self.weight_drop = weight_drop
        self.tie_weights = tie_weights
        self.generator: torch.Generator | None = None

        self.encoder = nn.Embedding(ntoken, emb_size)
        self.layers = nn.ModuleList()
        for l in range(num_layers):
            last = l == num_layers - 1
            n_in = emb_size if l == 0 else hidden_size
            n_out = emb_size if last and tie_weights else hidden_size
            self.layers.append(WeightDropLSTM(n_in, n_out, weight_drop))
        self.decoder = nn.Linear(self.layers[-1].hidden_size, ntoken)
        self.reset_parameters()
        if tie_weights:
            self.decoder.weight = self.encoder.weight

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        if not self.tie_weights:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        for layer in self.layers:
            layer.reset_parameters()

    def init_hidden(self, batch_size: int) -> list[LayerHidden]:
        """Zero state: one ``(h, c)`` pair per layer, each ``[1, batch_size, layer width]``."""
        w = self.encoder.weight
        shapes = [(1, batch_size, layer.hidden_size) for layer in self.layers]
        return [(w.new_zeros(shape), w.new_zeros(shape)) for shape in shapes]

    def forward(self, tokens: Tensor, hidden: list[LayerHidden] | None = None) -> LMOutput:
        """``tokens``: ``[T, B]`` int64; ``hidden``: from :meth:`init_hidden` or a previous call
        (zeros when None)."""
        if tokens.dim() != 2:
            raise ValueError(f"AWDLSTM expects tokens of shape [T, B], got {tuple(tokens.shape)}")
        if hidden is None:
            hidden = self.init_hidden(tokens.size(1))
        training, g = self.training, self.generator
        x = embedding_dropout(self.encoder.weight, tokens, self.dropout_e, training, g)
        x = locked_dropout(x, self.dropout_i, training, g)
        new_hidden: list[LayerHidden] = []
        for l, layer in enumerate(self.layers):
            x, h = layer(x, hidden[l])
            new_hidden.append(h)
            if l != self.num_layers - 1:
                x = locked_dropout(x, self.dropout_h, training, g)
        raw_output = x
        output = locked_dropout(raw_output, self.dropout, training, g)
        return LMOutput(self.decoder(output), new_hidden, raw_output, output)

    def extra_repr(self) -> str:
        return (
            f"ntoken={self.ntoken}, dropout={self.dropout}, dropout_h={self.dropout_h}, "
            f"dropout_i={self.dropout_i}, dropout_e={self.dropout_e}, "
            f"tie_weights={self.tie_weights}"
        )
