"""What a run records beside its loss: the code version, and the statistics that explain its
progress (gradient norms, clip fractions, step lengths, how far the averaged model moved).
None of it may change a number of the run itself."""

import json
import re

import pytest

from localclip.cli import main

from helpers import SMOKE

BASE = ["--workers", "3", "--period", "4", "--max-steps", "24", "--set", "eval_interval=12", "--set", "threads=1"]


def run(tmp_path, name, *args):
    out = tmp_path / name
    base = list(BASE)
    if "naive" in args:  # naive's period is 1: giving another is refused
        del base[base.index("--period") : base.index("--period") + 2]
    assert main(["train", "ptb-small", *SMOKE, *base, *args, "--out", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return out, [json.loads(line) for line in lines], json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("algorithm", ["celgc", pytest.param("naive", marks=pytest.mark.full)])
def test_statistics_do_not_change_the_run(tmp_path, algorithm):
    # Sampling the mean gradient at every step instead of every 12th reads every gradient once
    # more and all-reduces it: the model must come out bit for bit the same.
    _, _, every = run(tmp_path, "every", "--algorithm", algorithm, "--set", "log_interval=1")
    _, _, sparse = run(tmp_path, "sparse", "--algorithm", algorithm, "--set", "log_interval=12")
    assert every["model/sha256"] == sparse["model/sha256"]
    assert every["val/ppl"] == sparse["val/ppl"]


def test_local_statistics_follow_the_clipped_step(tmp_path):
    # CELGC without momentum or weight decay: a step is min(lr·‖g‖, γ) long, and it is clipped
    # exactly when the local norm exceeds γ/lr; logged every step, the records must say so.
    _, records, _ = run(tmp_path, "celgc", "--algorithm", "celgc", "--workers", "1", "--set", "log_interval=1")
    train = [r for r in records if "train/loss" in r]
    assert len(train) == 24
    for r in train:
        norm, lr, gamma = r["grad/local_norm"], r["lr"], r["gamma"]
        assert r["step/length"] == pytest.approx(min(lr * norm, gamma), rel=1e-5)
        assert r["clip/local_fraction"] == r["clip/fraction"] == float(lr * norm > gamma)
        # One worker: the mean is its own gradient. The sample's norm is summed in float64, the
        # optimizer's in float32 dot products, which are off by up to ~2e-4 relative on this model.
        assert r["grad/mean_norm"] == pytest.approx(norm, rel=1e-3)
    assert 0 < sum(r["clip/fraction"] for r in train) < len(train), "the test should see clipped and unclipped steps"


@pytest.mark.full  # three workers, 24 steps
def test_naive_records_local_and_mean_gradients(tmp_path):
    _, records, _ = run(tmp_path, "naive", "--algorithm", "naive", "--set", "log_interval=1")
    train = [r for r in records if "train/loss" in r]
    for r in train:
        # naive clips the mean gradient: its step is min(lr·‖mean‖, γ) (to the precision of the
        # optimizer's float32 norm, as above), and the mean of three different gradients is
        # shorter than their mean norm
        assert r["step/length"] == pytest.approx(min(r["lr"] * r["grad/mean_norm"], r["gamma"]), rel=1e-3)
        assert r["grad/mean_norm"] < r["grad/local_norm"]
        if abs(r["lr"] * r["grad/mean_norm"] - r["gamma"]) > 1e-3 * r["gamma"]:
            assert r["clip/fraction"] == float(r["lr"] * r["grad/mean_norm"] > r["gamma"])


@pytest.mark.full  # three workers, 24 steps
def test_evaluations_record_how_far_the_averaged_model_moved(tmp_path):
    _, records, _ = run(tmp_path, "celgc", "--algorithm", "celgc", "--set", "log_interval=4")
    evals = [r for r in records if "val/ppl" in r and not r.get("final")]
    assert [r["step"] for r in evals] == [12, 24]
    train = {r["step"]: r for r in records if "train/loss" in r}
    for first, r in zip((1, 13), evals):
        # the path is the sum of the mean local step lengths over the steps since the last evaluation
        steps = range(first + 3, first + 12, 4)
        assert r["move/path"] == pytest.approx(sum(4 * train[s]["step/length"] for s in steps), rel=1e-6)
        assert 0 < r["move/displacement"] <= r["move/path"]
        assert r["move/efficiency"] == pytest.approx(r["move/displacement"] / r["move/path"])


@pytest.mark.full  # three workers, 24 steps
def test_runs_record_the_code_that_made_them(tmp_path, capsys):
    out, _, summary = run(tmp_path, "celgc", "--algorithm", "celgc")
    config = json.loads((out / "config.json").read_text())
    for record in (config["provenance"], summary["provenance"]):
        import torch

        assert record["torch"] == torch.__version__
        assert re.fullmatch(r"[0-9a-f]{40}", record["commit"] or ""), record
        assert isinstance(record["dirty"], bool)
        assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and record["cpu"]
    # A run is made by one code version: a resume under another commit is refused, touching nothing.
    resume = ["train", "ptb-small", *BASE[:-4], "--max-steps", "28", "--set", "eval_interval=12", "--set", "threads=1",
              "--algorithm", "celgc", "--resume", "--out", str(out), *SMOKE]
    started = config["provenance"]["commit"]
    config["provenance"]["commit"] = "0" * 40
    (out / "config.json").write_text(json.dumps(config))
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert main(resume) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"commit 000000000000 in the run, {started[:12]} now" in error, error
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    # Under the code that started it, the same resume goes on.
    config["provenance"]["commit"] = started
    (out / "config.json").write_text(json.dumps(config))
    assert main(resume) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 28


@pytest.mark.parametrize("options", [dict(weight_decay=0.01), dict(momentum=0.9), dict(momentum=0.9, weight_decay=0.01)])
def test_the_step_length_is_the_parameters_displacement(options):
    import torch

    from localclip.optim import ClippedSGD

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(7, 3))]
    opt = ClippedSGD(params, lr=0.5, gamma=0.3, **options)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in params]
        opt.step()
        moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(params, before)]).norm()
        assert float(opt.last_step_length) == pytest.approx(float(moved), rel=1e-5)
