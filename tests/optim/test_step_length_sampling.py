"""The step-length statistic costs only the steps whose statistics are sampled: an unmeasured
ClippedSGD step is its norm and its update, and the trainer asks for the length at the last
step of each logging interval (and of each epoch) only."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from localclip import ClippedSGD


class CountReads(TorchDispatchMode):
    """Counts the reductions an optimizer step runs (dot products and norms)."""

    REDUCTIONS = {"dot", "linalg_vector_norm", "norm", "_foreach_norm", "sum", "vdot"}

    def __init__(self):
        super().__init__()
        self.reductions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in self.REDUCTIONS:
            self.reductions += 1
        return func(*args, **(kwargs or {}))


def _step(measure, path, momentum, weight_decay, steps=3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((300, 7), (7,), (5000,))]
    opt = ClippedSGD(params, lr=0.5, gamma=0.05, momentum=momentum, weight_decay=weight_decay, **path)
    opt.measure_step_length = measure
    counts = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with CountReads() as mode:
            opt.step()
        counts.append(mode.reductions)
    return params, opt, counts


@pytest.mark.parametrize("path", [dict(fused=True), dict(foreach=True, fused=False), dict(foreach=False, fused=False)], ids=["fused", "foreach", "loop"])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 1.2e-6), (0.9, 0.0), (0.9, 1.2e-6)])
def test_an_unmeasured_step_reduces_only_its_gradient_norm(path, momentum, weight_decay):
    measured, opt_on, on = _step(True, path, momentum, weight_decay)
    plain, opt_off, off = _step(False, path, momentum, weight_decay)
    # The clip norm: one dot product per gradient and their sum; nothing over x or the buffer.
    assert off == [4, 4, 4], off
    assert min(on) > 4, on  # measuring costs the extra reductions
    for a, b in zip(measured, plain):
        assert torch.equal(a, b)  # measuring changes no parameter
    assert torch.isnan(opt_off.last_step_length) and torch.isfinite(opt_on.last_step_length)


def test_the_trainer_measures_the_sampled_steps_only(tmp_path, monkeypatch):
    from localclip.cli import main

    from helpers import SMOKE

    measured = []
    step = ClippedSGD.step

    def recording_step(self, closure=None):
        measured.append(getattr(self, "measure_step_length", None))
        return step(self, closure)

    monkeypatch.setattr(ClippedSGD, "step", recording_step)
    out = tmp_path / "run"
    # 22 steps cut the first epoch: its last interval (steps 21-22) is logged early, unsampled,
    # as a run with a larger budget passes step 22.
    assert main(["train", "ptb-small", *SMOKE, "--workers", "1", "--period", "4", "--max-steps", "22",
                 "--set", "eval_interval=0", "--set", "threads=1", "--set", "log_interval=5", "--out", str(out)]) == 0
    assert len(measured) == 22
    assert [i + 1 for i, m in enumerate(measured) if m] == [5, 10, 15, 20]
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "train/loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 22]
    assert all(r["step/length"] > 0 and r["grad/mean_norm"] > 0 for r in train[:-1])
    assert "step/length" not in train[-1] and "grad/mean_norm" not in train[-1]


def test_the_last_step_of_an_epoch_is_sampled(tmp_path, monkeypatch):
    from localclip.cli import main
    from localclip.data.corpora import CORPORA

    from helpers import write_tiny_ptb

    write_tiny_ptb(tmp_path / "data" / CORPORA["ptb"].folder, train_lines=100)
    measured = []
    step = ClippedSGD.step

    def recording_step(self, closure=None):
        measured.append(getattr(self, "measure_step_length", None))
        return step(self, closure)

    monkeypatch.setattr(ClippedSGD, "step", recording_step)
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--data-root", str(tmp_path / "data"), "--allow-custom-corpus", "--no-progress",
                 "--workers", "1", "--period", "4", "--epochs", "1", "--set", "eval_tokens=2000", "--set", "threads=1",
                 "--set", "log_interval=3", "--out", str(out)]) == 0
    steps = len(measured)
    assert steps % 3, "the epoch must end inside a logging interval"
    assert [i + 1 for i, m in enumerate(measured) if m] == [s for s in range(1, steps + 1) if s % 3 == 0 or s == steps]
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "train/loss" in r]
    assert train[-1]["step"] == steps and all(r["step/length"] > 0 for r in train)
