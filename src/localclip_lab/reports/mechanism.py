"""Why one run trails another: the statistics every run logs beside its loss, per epoch.

A run's ``metrics.jsonl`` records, per logging interval, the mean norm of the workers' own
gradients (``grad/local_norm``), the norm of their mean (``grad/mean_norm``, sampled once per
interval), how often the algorithm clipped (``clip/fraction``: for naive parallel clipping the
mean gradient, for CELGC each worker's own), how often a worker's own gradient exceeds the clip
norm (``clip/local_fraction``), the length of a local step (``step/length``, sampled once per
interval) and, per
evaluation, the averaged model's displacement against the workers' mean path
(``move/efficiency``; see :mod:`localclip.train.metrics`). This module averages them per epoch
into ``mechanism.csv`` and draws ``mechanism.png``, one panel per statistic, one line per run.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

__all__ = ["STATISTICS", "has_statistics", "mechanism_rows", "write_mechanism"]

#: (key, what the panel shows, log scale?) in panel order.
STATISTICS = (
    ("grad/local_norm", "mean norm of a worker's own gradient", True),
    ("grad/mean_norm", "norm of the workers' mean gradient", True),
    ("clip/fraction", "fraction of steps the algorithm clipped", False),
    ("clip/local_fraction", "fraction of steps a worker's own gradient exceeds γ/η", False),
    ("step/length", "length of a local step ‖Δx‖", True),
    ("move/efficiency", "averaged model's displacement / workers' mean path", False),
)


def has_statistics(data: dict) -> bool:
    return any("grad/local_norm" in r for r in data["train"])


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def mechanism_rows(finished: dict) -> list[dict]:
    """One row per (run, epoch): each statistic's mean over the epoch's records."""
    rows = []
    for run, data in finished.items():
        records = [r for r in data["train"] + data["val"] if not r.get("final")]
        epochs = sorted({max(0, math.ceil(r["epoch"]) - 1) for r in records if "epoch" in r})
        for epoch in epochs:
            row = {"run": run, "epoch": epoch + 1}
            for key, _, _ in STATISTICS:
                values = [r[key] for r in records if key in r and _finite(r[key]) and epoch < r["epoch"] <= epoch + 1]
                row[key] = sum(values) / len(values) if values else None
            rows.append(row)
    return rows


def write_mechanism(finished: dict, folder: Path, title: str) -> dict:
    """Write ``mechanism.csv`` (always) and ``mechanism.png`` (with matplotlib) into ``folder``
    for the runs of ``finished`` that log the statistics; return ``{"csv", "figure"}``."""
    from localclip.train.run_folder import atomic_write_text

    runs = {run: data for run, data in finished.items() if has_statistics(data)}
    rows = mechanism_rows(runs)
    columns = ["run", "epoch", *(key for key, _, _ in STATISTICS)]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k]) for k in columns})
    atomic_write_text(folder / "mechanism.csv", buffer.getvalue())
    return {"csv": str(folder / "mechanism.csv"), "figure": _figure(runs, folder / "mechanism.png", title)}


def _clip_norms(runs: dict) -> list[float]:
    """The distinct clip norms γ/η the runs' records log (lr and γ decay together, so a run
    usually has one), at most three; none when the runs have more (a line each would hide the curves)."""
    norms = {round(r["gamma"] / r["lr"], 4) for data in runs.values() for r in data["train"]
             if _finite(r.get("gamma")) and _finite(r.get("lr")) and r["lr"] > 0}
    return sorted(norms) if len(norms) <= 3 else []


def _figure(runs: dict, out: Path, title: str) -> str:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    for ax, (key, label, log) in zip(axes.flat, STATISTICS):
        drawn = []
        for run, data in runs.items():
            records = [r for r in data["train"] + data["val"] if key in r and _finite(r[key]) and not r.get("final")]
            if not records:
                continue
            ax.plot([r["epoch"] for r in records], [r[key] for r in records], label=run, linewidth=1.0)
            drawn += [r[key] for r in records]
        # A log axis only where the values span more than a decade: within one it shows no tick.
        if log and drawn and min(drawn) > 0 and max(drawn) > 10 * min(drawn):
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if key.endswith("fraction") or key == "move/efficiency":
            ax.set_ylim(-0.02, 1.02)
        if key.startswith("grad/") and drawn:
            # The threshold the norms are clipped at, so that a reader sees which side they fall on.
            # In the legend, not written on the line, where it would collide with the curves.
            for clip in _clip_norms(runs):
                ax.axhline(clip, color="0.4", linestyle=":", linewidth=1.0, label=f"clip norm γ/η = {clip:g}")
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("epochs (passes over the training set)")
        ax.grid(alpha=0.3, which="both")
        if drawn:
            ax.legend(fontsize="x-small")
        else:
            # Naive parallel clipping has no local path, so it logs no displacement ratio: say
            # so rather than leave an empty frame that reads as a plotting failure.
            ax.text(0.5, 0.5, "no run of this sweep logs it", transform=ax.transAxes, ha="center", va="center", color="0.4")
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"{title}: what each run's steps look like", fontsize="large")
    from localclip.plot import save_figure

    return str(save_figure(fig, out, dpi=100))
