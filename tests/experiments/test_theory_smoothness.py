"""The theory check on the synthetic (L0, L1)-smooth problem, and the smoothness probe."""

import json
import math

import pytest
import torch

from localclip.cli import main
from localclip.errors import ConfigError, RunFolderError
from localclip_lab import smoothness, synthetic
from localclip.train.config import flat_view

from helpers import SHARED, SMOKE_DATA


def test_celgc_speeds_up_linearly_on_the_synthetic_problem():
    """The paper's linear speed-up, on a tiny instance: η and γ scaled by N (γ/η fixed), the
    steps to ‖∇f‖ <= target fall as 1/N; at least 0.7·N up to N = 8."""
    problem = synthetic.CoshProblem()
    rows = synthetic.speedup(problem, workers=(1, 2, 4, 8), period=4, lr=0.008, gamma=0.128, target=0.3, seeds=(0,), max_steps=5000)
    assert all(r["steps"] is not None for r in rows), rows
    for row in rows:
        assert row["speed-up"] >= 0.7 * row["N"], rows
    assert 0 < rows[0]["clip fraction"] < 0.5  # clipping acts far from the minimum, not everywhere
    assert rows[0]["rounds"] == 0 and rows[-1]["rounds"] == rows[-1]["steps"] // 4


def test_rounds_fall_with_the_period_at_about_the_same_steps():
    problem = synthetic.CoshProblem()
    rows = synthetic.period_sweep(problem, workers=4, periods=(1, 8), lr=0.008, gamma=0.128, target=0.3, seeds=(0,), max_steps=5000)
    one, eight = rows
    assert eight["steps"] <= 1.3 * one["steps"] and eight["rounds"] <= one["rounds"] / 6


def test_the_synthetic_problem_is_l0_l1_smooth_and_checks_its_inputs():
    problem = synthetic.CoshProblem(dim=3, a=2.0)
    x = torch.tensor([0.0, 1.0, -2.5], dtype=torch.float64)
    hessian = problem.a**2 * torch.cosh(problem.a * x)
    assert torch.all(hessian <= problem.L0 + problem.L1 * problem.grad(x).abs() + 1e-12)
    with pytest.raises(ConfigError, match="Invalid a"):
        synthetic.CoshProblem(a=0.0)
    with pytest.raises(ConfigError, match="Invalid workers"):
        synthetic.run_celgc(problem, workers=0, period=1, lr=0.1, gamma=1.0, target=0.1)


def _exp_l0_l1(x, l0, l1):
    """h(x) = (L0/L1²)(e^{L1|x|} − 1 − L1|x|): h'' = L0·e^{L1|x|} = L0 + L1·|h'| exactly."""
    return l0 / l1**2 * (torch.exp(l1 * x.abs()) - 1 - l1 * x.abs())


def test_local_smoothness_recovers_a_known_l0_and_l1():
    l0, l1 = 2.0, 1.5
    grads, estimates = [], []
    for value in torch.linspace(-4, 4, 33, dtype=torch.float64):
        x = value.clone().reshape(1).requires_grad_(True)
        fn = lambda x=x: _exp_l0_l1(x, l0, l1).sum()  # noqa: E731
        (g,) = torch.autograd.grad(fn(), [x])
        norm, estimate = smoothness.local_smoothness(fn, [x], [-1e-6 * g if g.abs() > 0 else torch.full_like(x, 1e-6)])
        assert estimate == pytest.approx(l0 + l1 * norm, rel=2e-3)
        assert float(x.detach()) == float(value)  # restored
        grads.append(norm)
        estimates.append(estimate)
    fit = smoothness.fit_l0_l1(grads, estimates)
    assert fit["L0"] == pytest.approx(l0, rel=0.01) and fit["L1"] == pytest.approx(l1, rel=0.01) and fit["r2"] > 0.999
    assert smoothness.fit_l0_l1([1.0, 2.0, 3.0], [5.0, 4.0, 3.0])["L1"] == 0.0  # falls with the gradient: a constant
    with pytest.raises(ValueError, match="at least 2"):
        smoothness.fit_l0_l1([1.0], [1.0])


def test_smoothness_probe_refuses_what_it_cannot_probe(tmp_path):
    with pytest.raises(RunFolderError, match="not a run folder"):
        smoothness.probe_run(tmp_path)
    assert main(["smoothness", str(tmp_path)]) == 2


def test_smoothness_probe_on_a_short_run(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--workers", "2", "--max-steps", "4", "--out", str(out), *SMOKE_DATA,
                 "--no-progress", "--set", "eval_tokens=2000", "--set", "checkpoint_interval=2", "--set", "threads=1"])
    assert code == 0
    capsys.readouterr()
    assert main(["smoothness", str(out), "--steps", "2"]) == 0
    printed = capsys.readouterr()
    assert "fit L(x)" in printed.out
    # Two kept checkpoints: the fit rests on three starting points, and the probe says so.
    assert f"localclip: warning: only 2 checkpoint(s) in {out / 'checkpoints'}: the fit rests on 3 starting point(s)" in printed.err
    result = json.loads((out / "smoothness.json").read_text())
    assert result["sources"][0] == "start" and len(result["sources"]) >= 2
    assert len(result["points"]) == 2 * len(result["sources"])
    assert all(p["grad_norm"] > 0 and p["smoothness"] > 0 and math.isfinite(p["smoothness"]) for p in result["points"])
    assert result["fit"]["L0"] >= 0 and result["fit"]["L1"] >= 0
    assert (out / "smoothness.png").stat().st_size > 10_000


# -- figures are optional: without matplotlib the numbers are still written -----------------------

NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib now raises ImportError, as when it is not installed
from localclip_lab import synthetic
synthetic.DEFAULTS.update(lr=0.008, gamma=0.128, target=1.0)  # a quick theory check
from localclip.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_matplotlib(*argv):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, *argv], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.full  # three CLI processes, the theory check among them
def test_report_theory_and_smoothness_write_their_numbers_without_matplotlib(tmp_path):
    import shutil
    from helpers import REPO as repo

    root = tmp_path / "sweeps"
    shutil.copytree(repo / "results" / "early-training" / "compression", root / "compression",
                    ignore=shutil.ignore_patterns("*.png", "summary.csv", "summary.md"))
    code, out, err = _without_matplotlib("report", "compression", "--root", str(root))
    assert code == 0, err
    assert (root / "compression" / "summary.csv").exists() and (root / "compression" / "summary.md").exists()
    assert not list((root / "compression").glob("*.png"))
    assert err.strip() == "localclip: no figure: it needs matplotlib (pip install 'localclip[plot]')"

    code, out, err = _without_matplotlib("theory", "--out", str(tmp_path / "theory"), "--seeds", "1")
    assert code == 0, err + out
    assert (tmp_path / "theory" / "results.json").exists() and (tmp_path / "theory" / "summary.md").exists()
    assert not (tmp_path / "theory" / "figure.png").exists() and "figure.png" not in out
    assert err.strip() == "localclip: no figure: it needs matplotlib (pip install 'localclip[plot]')"

    run = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "4", "--out", str(run), *SMOKE_DATA, "--no-progress",
                 "--set", "eval_tokens=2000", "--set", "checkpoint_interval=2", "--set", "threads=1"]) == 0
    code, out, err = _without_matplotlib("smoothness", str(run), "--steps", "2")
    assert code == 0, err
    assert (run / "smoothness.json").exists() and not (run / "smoothness.png").exists()
    assert "localclip: no figure: it needs matplotlib (pip install 'localclip[plot]')" in err.splitlines()


def test_smoothness_of_a_run_whose_data_root_is_relative_reads_the_data_where_train_looks(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "2", "--out", str(out), *SMOKE_DATA, "--no-progress",
                 "--set", "eval_tokens=2000", "--set", "checkpoint_interval=1", "--set", "threads=1"]) == 0
    config = flat_view(json.loads((out / "config.json").read_text()))  # flat, as the committed runs are
    config["data_root"] = "../shared/data"  # as a committed run stores it: relative to where it ran
    (out / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCALCLIP_DATA", str(SHARED))
    capsys.readouterr()
    assert main(["smoothness", str(out), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert f"the run's data_root ('../shared/data', in {out / 'config.json'}) does not exist from here; reading the data from {SHARED}" in err
    assert json.loads((out / "smoothness.json").read_text())["points"]
