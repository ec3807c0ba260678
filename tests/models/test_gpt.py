"""The GPT model: the LM contract, causality, dropout from the worker's generator, its init, the
context check, and a short training run through the CLI."""

import json
import math
from pathlib import Path

import pytest
import torch

from localclip.cli import main
from localclip.errors import ConfigError
from localclip.models import GPT, build_model
from localclip.recipes import get_recipe
from localclip.algorithms import build
from helpers import SMOKE_DATA



def small(**kw):
    torch.manual_seed(0)
    return GPT(50, **{**dict(n_layer=2, n_head=2, n_embd=16, block_size=12, dropout=0.0), **kw})


def test_sequence_first_contract_and_tied_embeddings():
    model = build_model("gpt", ntoken=50, n_layer=2, n_head=2, n_embd=16, block_size=12)
    tokens = torch.randint(0, 50, (12, 3))
    out = model(tokens, model.init_hidden(3))
    assert out.logits.shape == (12, 3, 50) and out.hidden is None
    assert out.raw_output.shape == out.output.shape == (12, 3, 16)
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_attention_is_causal():
    model = small().eval()
    tokens = torch.randint(0, 50, (10, 2))
    changed = tokens.clone()
    changed[6] = (changed[6] + 1) % 50
    a, b = model(tokens).logits, model(changed).logits
    assert torch.equal(a[:6], b[:6])  # the past does not see the future
    assert not torch.allclose(a[6:], b[6:])


def test_the_explicit_attention_path_equals_sdpa():
    """Attention dropout computes the weights by hand; with a vanishing rate it must agree."""
    tokens = torch.randint(0, 50, (8, 2))
    fused = small().train()(tokens).logits
    explicit = small(attn_dropout=1e-12).train()(tokens).logits
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-6)


def test_dropout_draws_only_from_the_models_generator():
    model = small(dropout=0.3, attn_dropout=0.2).train()
    tokens = torch.randint(0, 50, (8, 2))
    model.generator = torch.Generator().manual_seed(7)
    default_before = torch.get_rng_state()
    first = model(tokens).logits
    assert torch.equal(torch.get_rng_state(), default_before)  # the global stream is untouched
    model.generator = torch.Generator().manual_seed(7)
    assert torch.equal(model(tokens).logits, first)
    model.generator = torch.Generator().manual_seed(8)
    assert not torch.equal(model(tokens).logits, first)
    model.eval()
    assert torch.equal(model(tokens).logits, model(tokens).logits)  # no dropout in eval


def test_init_scales_the_residual_projections_by_depth():
    model = GPT(1000, n_layer=8, n_head=4, n_embd=128, block_size=16)
    proj = torch.cat([b.attn.c_proj.weight.reshape(-1) for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.all(b.ln_1.weight == 1) for b in model.blocks)


def test_context_longer_than_the_block_is_refused():
    model = small()
    with pytest.raises(ConfigError, match="GPT context too long: 13 tokens, but block_size is 12"):
        model(torch.zeros(13, 1, dtype=torch.long))


@pytest.mark.parametrize("bad", [dict(n_embd=10, n_head=4), dict(dropout=1.0), dict(block_size=0), dict(widht=3)])
def test_bad_sizes_are_named(bad):
    with pytest.raises(ConfigError):
        GPT(50, **bad)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["--set", "bptt=80"], "Invalid bptt: 80 tokens per window exceed the GPT's context"),
        (["--set", "eval_bptt=65"], "Invalid eval_bptt: 65 tokens"),
        (["--set", "variable_bptt=true"], "Invalid variable_bptt=True"),
    ],
)
def test_cli_gpt_context_too_long_is_one_line_and_no_run_folder(tmp_path, capsys, overrides, match):
    out = tmp_path / "run"
    code = main(["train", "ptb-gpt-small", "--out", str(out), "--no-progress", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err
    assert not out.exists()


def test_recipes_fit_their_contexts():
    for name in ("ptb-gpt-small", "wt2-gpt"):
        cfg = build.resolved(get_recipe(name))
        assert cfg.workload.bptt <= cfg.workload.model_options["block_size"]


TINY = ["--set", "model_options.n_embd=32", "--set", "model_options.n_layer=1", "--set", "model_options.block_size=16",
        "--set", "bptt=16", "--set", "eval_bptt=16", "--set", "eval_tokens=2000", "--set", "log_interval=4"]


@pytest.mark.parametrize("inner", ["clipped_sgd", "adamw"])
def test_gpt_trains_with_celgc_through_the_cli(tmp_path, inner):
    out = tmp_path / inner
    lr = ["--lr", "3e-3", "--set", "max_grad_norm=1.0"] if inner == "adamw" else []
    code = main(["train", "ptb-gpt-small", "--workers", "2", "--period", "2", "--max-steps", "12", "--inner-optimizer", inner,
                 *SMOKE_DATA, "--no-progress", "--out", str(out), *TINY, *lr])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["comm/rounds"] == 12 // 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0] < 1.1 * math.log(10000)
    assert math.isfinite(summary["val/ppl"]) and summary["val/ppl"] < 10000
    if inner == "adamw":
        assert all("gamma" not in r for r in records if "train/loss" in r)
        assert json.loads((out / "config.json").read_text())["local"]["inner_optimizer"] == "adamw"


@pytest.mark.full  # a killed process
def test_resume_with_adamw_after_a_kill_is_bit_identical(tmp_path):
    """K steps straight == killed after a checkpoint, then --resume to K (GPT, clipped AdamW,
    Adam moments averaged at rounds)."""
    from helpers import kill_after_first_checkpoint

    # threads=1 as in every sweep: the GPT's bits depend on each worker's thread count, so it is
    # pinned rather than left to each process's view of the machine.
    args = ["--workers", "2", "--period", "3", "--max-steps", "24", "--inner-optimizer", "adamw", "--lr", "3e-3",
            "--set", "max_grad_norm=0.5", "--set", "optimizer_state=average", "--set", "checkpoint_interval=4",
            "--set", "model_options.dropout=0.2", "--set", "threads=1", *SMOKE_DATA, "--no-progress", *TINY]
    assert main(["train", "ptb-gpt-small", *args, "--out", str(tmp_path / "straight")]) == 0
    out = tmp_path / "killed"
    latest = json.loads(kill_after_first_checkpoint(["ptb-gpt-small", *args], out, poll=0.02).read_text())
    assert main(["train", "ptb-gpt-small", *args, "--resume", "--out", str(out)]) == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    read = lambda p: [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in (p / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    # The records first: where they part says at which logged step the runs did.
    for got, want in zip(read(out), read(tmp_path / "straight"), strict=True):
        assert got == want, f"step {want.get('step')} (resumed from step {latest['step']})"
    for key in ("model/sha256", "val/ppl", "test/ppl", "val/loss", "comm/rounds", "comm/bytes", "steps"):
        assert resumed[key] == straight[key], key
