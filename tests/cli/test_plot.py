"""`localclip plot` as a user reads it: the final validation of a run without mid-run ones, a
diverged run marked, plain numbers on log axes, wall-clock panels that a single worker does not
stretch, lines that coincide still both visible."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.figure  # noqa: E402

from localclip import jsonio  # noqa: E402
from localclip.cli import EXIT_DIVERGED, main  # noqa: E402
from localclip.plot import plot_runs  # noqa: E402
from helpers import SMOKE_DATA  # noqa: E402

SMOKE = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000", "--set", "log_interval=2", "--workers", "2", "--period", "2"]


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_runs saves, kept for inspection."""
    figures = []
    real = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def _legend(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """A --max-steps run (its only validation is the final one) and a diverged one."""
    root = tmp_path_factory.mktemp("plot")
    assert main(["train", "ptb-small", "--max-steps", "4", "--out", str(root / "short"), *SMOKE]) == 0
    assert main(["train", "ptb-small", "--max-steps", "4", "--algorithm", "local-sgd", "--lr", "1e6", "--out", str(root / "diverged"),
                 *SMOKE]) == EXIT_DIVERGED
    return root


def test_a_run_without_mid_run_validation_shows_its_final_one_in_one_panel(short_runs, drawn, tmp_path):
    plot_runs([str(short_runs / "short")], tmp_path / "f.png")
    (fig,) = drawn
    axes = fig.axes
    final = axes[4]  # bottom row, epochs
    assert final.get_ylabel() == "validation perplexity (log scale)"
    summary = jsonio.loads((short_runs / "short" / "summary.json").read_text())
    (line,) = final.get_lines()
    assert list(line.get_ydata()) == [summary["val/ppl"]]
    # Not three panels for one point: the rounds and wall-clock panels of that row are off.
    assert not axes[5].axison and not axes[6].axison


def test_a_diverged_run_is_marked_with_its_step(short_runs, drawn, tmp_path):
    plot_runs([str(short_runs / "diverged")], tmp_path / "f.png")
    (fig,) = drawn
    summary = jsonio.loads((short_runs / "diverged" / "summary.json").read_text())
    step = summary["diverged_at_step"]
    assert _legend(fig) == [f"local-sgd N=2 I=2 (diverged at step {step})"]
    texts = [t.get_text() for t in fig.axes[4].texts]
    assert texts == [f"local-sgd N=2 I=2: final val/ppl = {summary['val/ppl']:g} (diverged at step {step})"]


def _fake(folder: Path, algorithm: str, workers: int, ppls: list[float], seconds_per_step: float):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algorithm": algorithm, "workers": workers, "period": 8, "task": "lm"}))
    records = []
    for i, ppl in enumerate(ppls, 1):
        rounds = 0 if workers == 1 else i
        records.append({"step": 10 * i, "epoch": 0.1 * i, "train/loss": math.log(ppl), "time/compute": seconds_per_step * 10 * i,
                        "comm/rounds": rounds, "comm/bytes": 100 * rounds})
        records.append({"step": 10 * i, "epoch": 0.1 * i, "val/ppl": ppl, "comm/rounds": rounds, "comm/bytes": 100 * rounds})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"steps": 10 * len(ppls), "val/ppl": ppls[-1]}))


def test_log_axes_plain_numbers_wall_clock_fits_the_communicating_runs(tmp_path, drawn):
    ppls = [700.0, 400.0, 250.0, 180.0, 150.0, 130.0, 125.0, 120.0]
    _fake(tmp_path / "celgc", "celgc", 8, ppls, seconds_per_step=0.1)
    _fake(tmp_path / "celgc-bf16", "celgc", 8, ppls, seconds_per_step=0.1)  # the same curve
    _fake(tmp_path / "single", "single", 1, [p * 0.9 for p in ppls], seconds_per_step=0.8)
    plot_runs([str(tmp_path / n) for n in ("celgc", "celgc-bf16", "single")], tmp_path / "f.png", labels=["celgc", "bf16", "single"])
    (fig,) = drawn
    ppl_axis = fig.axes[4].yaxis
    assert ppl_axis.get_major_formatter()(175.0, 0) == "175" and ppl_axis.get_minor_formatter()(130.0, 0) == "130"
    assert fig.axes[1].xaxis.get_major_formatter()(100.0, 0) == "100"  # rounds
    # The wall-clock panels end where the 8-worker runs end (8 s), not at the single worker's 64 s.
    assert fig.axes[2].get_xlim()[1] == pytest.approx(8 * 1.05, rel=0.01)
    assert "single (wall-clock: beyond the right edge)" in _legend(fig)
    # Coinciding runs are both visible: different line styles, the earlier one wider.
    first, second = fig.axes[0].get_lines()[:2]
    assert first.get_linestyle() != second.get_linestyle() and first.get_linewidth() > second.get_linewidth()
    # The perplexity range is where the runs end (a 5 % gap between 120 and 126 is visible):
    low, high = fig.axes[4].get_ylim()
    assert high <= 1.6 * 120 * 1.05 + 1e-9 and low <= 0.9 * 120
