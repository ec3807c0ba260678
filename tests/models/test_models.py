"""Tests of localclip.models: sizes, the LM contract, weight drop, and parameter storage.

Small configurations keep the file fast; the full PTB AWD-LSTM is only built (never run) to
check its parameter count.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from localclip.errors import ConfigError
from localclip.models import (
    AWDLSTM,
    LSTMLM,
    MODELS,
    LMOutput,
    ar_tar_penalty,
    build_model,
    detach_hidden,
    resnet,
)
from localclip.models.lm import embedding_dropout, locked_dropout

NTOKEN = 50
T, B = 7, 3


def small_awd(**kwargs) -> AWDLSTM:
    cfg = dict(emb_size=8, hidden_size=12, num_layers=3)
    cfg.update(kwargs)
    return AWDLSTM(NTOKEN, **cfg)


def small_lstm(**kwargs) -> LSTMLM:
    cfg = dict(emb_size=10, hidden_size=10, num_layers=2)
    cfg.update(kwargs)
    return LSTMLM(NTOKEN, **cfg)


LM_FACTORIES = {"awd": small_awd, "lstm": small_lstm}


@pytest.fixture(params=sorted(LM_FACTORIES))
def make_lm(request):
    return LM_FACTORIES[request.param]


def tokens(seed: int = 0, t: int = T, b: int = B) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, NTOKEN, (t, b), generator=g)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def awd_param_count(ntoken, emb, hidden, layers, tied) -> int:
    total = ntoken * emb + ntoken  # embedding, decoder bias
    for l in range(layers):
        n_in = emb if l == 0 else hidden
        h = emb if (l == layers - 1 and tied) else hidden
        total += 4 * h * (n_in + h) + 8 * h
    if not tied:
        total += ntoken * hidden
    return total


# --- parameter counts and storage ----------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_awd_param_count_is_analytic(tied):
    model = small_awd(tie_weights=tied)
    assert n_params(model) == awd_param_count(NTOKEN, 8, 12, 3, tied)


def test_awd_ptb_model_has_24m_params():
    model = AWDLSTM(10_000)
    expected = awd_param_count(10_000, 400, 1150, 3, True)
    assert n_params(model) == expected == 24_221_600


@pytest.mark.parametrize("model_fn", [small_awd, small_lstm, lambda: resnet(8)])
def test_each_parameter_exists_once(model_fn):
    model = model_fn()
    params = list(model.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert len({p.data_ptr() for p in params}) == len(params)
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(params)
    assert not any("raw" in n for n in names)


def test_awd_named_parameters():
    names = {n for n, _ in small_awd().named_parameters()}
    expected = {"encoder.weight", "decoder.bias"}
    for l in range(3):
        expected |= {f"layers.{l}.{w}" for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
    assert names == expected


@pytest.mark.parametrize("make", [small_awd, small_lstm])
def test_tied_decoder_shares_storage_with_embedding(make):
    tied = make()
    assert tied.decoder.weight is tied.encoder.weight
    assert tied.decoder.weight.data_ptr() == tied.encoder.weight.data_ptr()
    untied = make(tie_weights=False)
    assert untied.decoder.weight.data_ptr() != untied.encoder.weight.data_ptr()


def test_awd_layer_sizes():
    model = small_awd()
    assert [(l.input_size, l.hidden_size) for l in model.layers] == [(8, 12), (12, 12), (12, 8)]
    untied = small_awd(tie_weights=False)
    assert untied.layers[-1].hidden_size == 12
    assert untied.decoder.in_features == 12


def test_awd_init():
    model = AWDLSTM(200, emb_size=16, hidden_size=64)
    assert model.encoder.weight.abs().max() <= 0.1
    assert torch.all(model.decoder.bias == 0)
    for layer in model.layers:
        bound = layer.hidden_size**-0.5
        for p in layer.parameters():
            assert p.abs().max() <= bound
            assert p.abs().max() > 0.5 * bound


# --- forward contract ----------------------------------------------------------------------


def test_forward_shapes(make_lm):
    model = make_lm()
    out = model(tokens(), model.init_hidden(B))
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (T, B, NTOKEN)
    width = model.emb_size if isinstance(model, AWDLSTM) else model.hidden_size
    assert out.raw_output.shape == out.output.shape == (T, B, width)
    assert type(detach_hidden(out.hidden)) is type(out.hidden)
    # Hidden state keeps init_hidden's structure and shapes.
    flat = lambda h: [h] if isinstance(h, torch.Tensor) else [x for y in h for x in flat(y)]
    assert [x.shape for x in flat(out.hidden)] == [x.shape for x in flat(model.init_hidden(B))]


def test_hidden_defaults_to_zeros(make_lm):
    model = make_lm().eval()
    x = tokens()
    torch.testing.assert_close(model(x).logits, model(x, model.init_hidden(B)).logits)


def test_carried_hidden_equals_one_long_sequence(make_lm):
    # Truncated BPTT must not change the forward computation: two halves with the state
    # carried across equal one pass over the whole sequence.
    model = make_lm().eval()
    x = tokens(t=10)
    whole = model(x).logits
    first = model(x[:4])
    second = model(x[4:], detach_hidden(first.hidden))
    torch.testing.assert_close(torch.cat([first.logits, second.logits]), whole)


def test_detach_hidden_cuts_history(make_lm):
    model = make_lm().train()
    out = model(tokens())
    detached = detach_hidden(out.hidden)

    def walk(h):
        if isinstance(h, torch.Tensor):
            yield h
        else:
            for x in h:
                yield from walk(x)

    assert all(h.grad_fn is not None for h in walk(out.hidden))
    assert all(h.grad_fn is None and not h.requires_grad for h in walk(detached))
    with pytest.raises(TypeError):
        detach_hidden({"h": torch.zeros(1)})


def test_eval_is_deterministic_and_train_is_not(make_lm):
    model = make_lm()
    x = tokens()
    model.eval()
    torch.manual_seed(1)
    a = model(x).logits
    torch.manual_seed(2)
    b = model(x).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.train()
    torch.manual_seed(1)
    c = model(x).logits
    torch.manual_seed(1)
    d = model(x).logits
    torch.manual_seed(2)
    e = model(x).logits
    torch.testing.assert_close(c, d, rtol=0, atol=0)
    assert not torch.allclose(c, e)
    assert not torch.allclose(c, a)


def test_awd_eval_matches_nn_lstm_reference():
    # The fused kernel fed our parameters must compute exactly an nn.LSTM stack.
    model = small_awd().eval()
    x = tokens()
    emb = model.encoder(x)
    h = emb
    for layer in model.layers:
        ref = nn.LSTM(layer.input_size, layer.hidden_size)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(ref, f"{name}_l0").copy_(getattr(layer, name))
        h, _ = ref(h)
    expected = F.linear(h, model.encoder.weight, model.decoder.bias)
    torch.testing.assert_close(model(x).logits, expected)


# --- dropout forms ---------------------------------------------------------------------------


def test_embedding_dropout_drops_whole_words():
    weight = torch.randn(NTOKEN, 6, requires_grad=True)
    x = torch.tensor([[1, 2, 3, 1], [2, 3, 1, 4]] * 4)  # every word repeated
    torch.manual_seed(3)
    emb = embedding_dropout(weight, x, 0.5, training=True)
    for word in x.unique():
        rows = emb[x == word]
        scale = rows / weight[word]
        assert torch.allclose(scale, torch.zeros_like(scale)) or torch.allclose(
            scale, torch.full_like(scale, 2.0)
        ), int(word)
    # Equal, in value and gradient, to looking tokens up in a row-masked matrix.
    torch.manual_seed(3)
    mask = (torch.rand(NTOKEN, 1) >= 0.5).float() * 2
    ref = F.embedding(x, weight * mask)
    torch.testing.assert_close(emb, ref)
    (g1,) = torch.autograd.grad(emb.pow(2).sum(), weight)
    (g2,) = torch.autograd.grad(ref.pow(2).sum(), weight)
    torch.testing.assert_close(g1, g2)
    assert embedding_dropout(weight, x, 0.5, training=False).equal(F.embedding(x, weight))


def test_locked_dropout_shares_its_mask_over_time():
    x = torch.ones(20, 4, 30)
    torch.manual_seed(0)
    y = locked_dropout(x, 0.5, training=True)
    assert torch.all(y == y[:1])
    assert set(y.unique().tolist()) == {0.0, 2.0}
    assert locked_dropout(x, 0.5, training=False) is x


# --- weight drop ---------------------------------------------------------------------------


def only_weight_drop(p=0.5) -> AWDLSTM:
    return small_awd(dropout=0, dropout_h=0, dropout_i=0, dropout_e=0, weight_drop=p)


def test_weight_drop_changes_output_in_training_only():
    model = only_weight_drop()
    x = tokens()
    model.eval()
    clean = model(x).logits
    model.train()
    torch.manual_seed(1)
    a = model(x).logits
    torch.manual_seed(2)
    b = model(x).logits
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, clean)
    # With weight drop off and every other dropout at 0, training mode is the clean model.
    no_drop = only_weight_drop(0.0)
    no_drop.load_state_dict(model.state_dict())
    torch.testing.assert_close(no_drop.train()(x).logits, clean)


def test_weight_drop_mask_is_the_one_drawn_from_the_default_generator():
    layer = only_weight_drop().layers[0].train()
    x = torch.randn(T, B, layer.input_size)
    hx = (torch.zeros(1, B, layer.hidden_size), torch.zeros(1, B, layer.hidden_size))
    torch.manual_seed(5)
    out, _ = layer(x, hx)
    torch.manual_seed(5)
    keep = torch.rand(layer.weight_hh.shape) >= 0.5
    ref = nn.LSTM(layer.input_size, layer.hidden_size)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(layer.weight_ih)
        ref.weight_hh_l0.copy_(layer.weight_hh * keep * 2)
        ref.bias_ih_l0.copy_(layer.bias_ih)
        ref.bias_hh_l0.copy_(layer.bias_hh)
    torch.testing.assert_close(out, ref(x, hx)[0])
    # Gradient of the dropped matrix: zero exactly where the mask dropped a weight.
    out.sum().backward()
    grad = layer.weight_hh.grad
    assert torch.all(grad[~keep] == 0)
    assert grad[keep].abs().sum() > 0


def test_gradients_reach_every_parameter(make_lm):
    model = make_lm().train()
    torch.manual_seed(0)
    out = model(tokens())
    loss = F.cross_entropy(out.logits.view(-1, NTOKEN), tokens(1).view(-1))
    (loss + ar_tar_penalty(out, 2.0, 1.0)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
    if isinstance(model, AWDLSTM):
        assert all(layer.weight_hh.grad.abs().sum() > 0 for layer in model.layers)


def test_no_warnings_in_training_step(make_lm):
    model = make_lm().train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(tokens())
        out.logits.sum().backward()
        out = model(tokens(), detach_hidden(out.hidden))
        out.logits.sum().backward()


# --- copies, checkpoints, flat parameter storage -------------------------------------------


def test_state_dict_round_trip(make_lm):
    torch.manual_seed(0)
    src = make_lm()
    torch.manual_seed(1)
    dst = make_lm()
    x = tokens()
    assert not torch.allclose(src.eval()(x).logits, dst.eval()(x).logits)
    dst.load_state_dict(src.state_dict())
    torch.testing.assert_close(dst(x).logits, src(x).logits, rtol=0, atol=0)
    # Tying survives loading: the decoder still is the embedding.
    assert dst.decoder.weight is dst.encoder.weight


def test_deepcopy(make_lm):
    model = make_lm().eval()
    clone = copy.deepcopy(model)
    x = tokens()
    torch.testing.assert_close(clone(x).logits, model(x).logits, rtol=0, atol=0)
    assert clone.decoder.weight is clone.encoder.weight
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert not ptrs & {p.data_ptr() for p in clone.parameters()}
    # The copy trains on its own; the original is untouched.
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(0.01)
    assert not torch.allclose(clone(x).logits, model(x).logits)
    clone.train()(x).logits.sum().backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("make", [small_awd, small_lstm, lambda: resnet(8, in_channels=1)])
def test_parameters_can_live_in_one_flat_buffer(make):
    # The averaging layer points every p.data into one flat buffer and writes averages there;
    # the model must read its parameters live rather than from anything cached.
    model = make().eval()
    is_lm = isinstance(model, (AWDLSTM, LSTMLM))
    x = tokens() if is_lm else torch.randn(2, 1, 12, 12)
    run = (lambda: model(x).logits) if is_lm else (lambda: model(x))
    before = run()
    params = list(model.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    assert offset == flat.numel()
    torch.testing.assert_close(run(), before, rtol=0, atol=0)
    with torch.no_grad():
        flat.mul_(0.5)
    assert not torch.allclose(run(), before)
    # Training still works, and gradients have the parameters' shapes.
    model.train()
    run().sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)


# --- AR / TAR ------------------------------------------------------------------------------


def test_ar_tar_penalty():
    model = small_awd().train()
    out = model(tokens())
    zero = ar_tar_penalty(out, 0.0, 0.0)
    assert zero.dim() == 0 and zero.item() == 0
    assert ar_tar_penalty(out, 2.0, 0.0) > 0
    assert ar_tar_penalty(out, 0.0, 1.0) > 0
    expected = 2.0 * out.output.pow(2).mean() + 1.0 * (
        out.raw_output[1:] - out.raw_output[:-1]
    ).pow(2).mean()
    torch.testing.assert_close(ar_tar_penalty(out, 2.0, 1.0), expected)
    one_step = model(tokens(t=1))
    assert torch.isfinite(ar_tar_penalty(one_step, 2.0, 1.0))
    with pytest.raises(ValueError):
        ar_tar_penalty(out, -1.0, 0.0)


# --- validation ----------------------------------------------------------------------------


def test_lstm_tied_sizes_must_match():
    with pytest.raises(ValueError, match=r"emb_size=10.*hidden_size=20"):
        LSTMLM(NTOKEN, emb_size=10, hidden_size=20)
    LSTMLM(NTOKEN, emb_size=10, hidden_size=20, tie_weights=False)


def test_single_layer_lstm_lm_builds_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LSTMLM(NTOKEN, emb_size=10, hidden_size=10, num_layers=1, dropout=0.5)


@pytest.mark.parametrize(
    "kwargs", [dict(dropout=1.0), dict(weight_drop=-0.1), dict(num_layers=0), dict(emb_size=0)]
)
def test_awd_rejects_bad_config(kwargs):
    with pytest.raises(ConfigError):
        small_awd(**kwargs)


def test_lm_rejects_wrong_token_shape(make_lm):
    with pytest.raises(ValueError, match=r"\[T, B\]"):
        make_lm()(torch.zeros(5, dtype=torch.long))


# --- ResNet --------------------------------------------------------------------------------


def resnet_param_count(depth, num_classes=10, in_channels=3) -> int:
    # Option-A shortcuts add no parameters: stem + 3 stages of n blocks + classifier.
    n = (depth - 2) // 6
    total = 9 * in_channels * 16 + 2 * 16
    c_in = 16
    for c in (16, 32, 64):
        for _ in range(n):
            total += 9 * c_in * c + 9 * c * c + 4 * c
            c_in = c
    return total + 64 * num_classes + num_classes


@pytest.mark.parametrize("depth", [8, 14, 20, 32, 44, 56])
def test_resnet_param_count(depth):
    assert n_params(resnet(depth)) == resnet_param_count(depth)


def test_resnet32_has_046m_params():
    assert n_params(resnet(32)) == 464_154
    assert n_params(resnet(32, in_channels=1)) == resnet_param_count(32, in_channels=1)


@pytest.mark.parametrize("in_channels,size", [(1, 28), (3, 32)])
def test_resnet_forward_shapes(in_channels, size):
    model = resnet(20, num_classes=7, in_channels=in_channels)
    x = torch.randn(4, in_channels, size, size)
    out = model.train()(x)
    assert out.shape == (4, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.eval()(x).shape == (4, 7)


def test_resnet_batchnorm_buffers():
    model = resnet(8)
    buffers = dict(model.named_buffers())
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= set(buffers)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 1 + 2 * 3
    before = buffers["bn1.running_mean"].clone()
    model.train()(torch.randn(2, 3, 16, 16) + 1)
    assert not torch.equal(before, model.bn1.running_mean)


@pytest.mark.parametrize("depth", [7, 26, 110, "32"])
def test_resnet_rejects_other_depths(depth):
    with pytest.raises(ValueError, match=repr(depth)):
        resnet(depth)


# --- registry ------------------------------------------------------------------------------


def test_build_model():
    assert isinstance(build_model("awd_lstm", ntoken=NTOKEN, emb_size=8, hidden_size=12), AWDLSTM)
    assert isinstance(build_model("lstm", ntoken=NTOKEN, emb_size=8, hidden_size=8), LSTMLM)
    assert n_params(build_model("resnet32")) == 464_154
    assert n_params(build_model("resnet", depth=8)) == resnet_param_count(8)
    assert build_model("resnet20", in_channels=1).conv1.in_channels == 1
    assert "resnet56" in MODELS
    with pytest.raises(ValueError, match="'vgg'"):
        build_model("vgg")


def test_resnet_groupnorm_has_no_buffers_and_ignores_the_rest_of_the_batch():
    """norm="group": the same parameters as BatchNorm, no running statistics, and a sample's
    output in training mode does not depend on the other samples of its batch."""
    batch, group = resnet(8, in_channels=1), resnet(8, in_channels=1, norm="group")
    assert sum(p.numel() for p in group.parameters()) == sum(p.numel() for p in batch.parameters())
    assert list(group.buffers()) == [] and any(isinstance(m, nn.GroupNorm) for m in group.modules())
    group.train()
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    alone, together = group(x[:1]), group(torch.cat([x[:1], 10 * x[1:]]))[:1]
    torch.testing.assert_close(alone, together)
    with pytest.raises(ConfigError, match="'layer'"):
        resnet(8, norm="layer")
