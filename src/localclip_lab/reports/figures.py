"""A sweep's figures beyond the per-run curves of :func:`localclip.plot.plot_runs`: ``curves.png``
(``converge``: validation perplexity per epoch, a panel per group) and ``speedup.png``
(``speedup-converge``: validation perplexity against local steps and against epochs).
"""

from __future__ import annotations

import math
from pathlib import Path

from localclip_lab.reports.runs import epoch_ends, good, validations

__all__ = ["converge_curves", "speedup_curves"]


def converge_curves(finished: dict, groups: dict[str, list[str]], out: Path, name: str = "converge") -> Path:
    """Validation perplexity per epoch, a panel per group of :func:`converge_groups`."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(7.5 * len(groups), 5.2), constrained_layout=True, squeeze=False)
    for ax, (title, runs) in zip(axes[0], groups.items()):
        finite = []
        for run in runs:
            vals = validations(finished[run])
            x = [r["epoch"] for r in vals]
            y = [r["val/ppl"] if good(r["val/ppl"]) else math.nan for r in vals]
            finite += [v for v in y if math.isfinite(v)]
            diverged = not good(finished[run]["summary"].get("val/ppl"))
            ends = epoch_ends(finished[run])
            line, = ax.plot(x, y, label=run + (" (diverged)" if diverged else ""), linewidth=1.2)
            ax.plot(list(ends), [v if good(v) else math.nan for v in ends.values()], "o", markersize=3, color=line.get_color())
        if finite:
            # Fit the plateau, where the runs differ: early (and diverged) values leave the top.
            low = min(finite)
            ax.set_ylim(low * 0.97, min(max(finite), 2.0 * low) * 1.02)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 130, not 1.3×10²
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("epochs (passes over the training set)")
        ax.set_ylabel("validation perplexity (log scale)")
        ax.set_title(f"{title}; dots: end of an epoch")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.suptitle(f"sweep {name}: validation perplexity per epoch\n(values above 2x the lowest leave the top)", fontsize="medium")
    from localclip.plot import save_figure

    return save_figure(fig, out)


def speedup_curves(finished: dict, out: Path, name: str) -> Path:
    """speedup-converge: validation perplexity against local steps per worker (log scale, where
    linear speed-up puts 2N workers' curve at half N workers' steps) with the targets of
    ``SPEEDUP_TARGETS`` drawn in, and against epochs (equal samples for every N)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from localclip_lab.plans import SPEEDUP_TARGETS

    fig, (by_step, by_epoch) = plt.subplots(1, 2, figsize=(15, 5.2), constrained_layout=True)
    finite = []
    for run, data in sorted(finished.items(), key=lambda item: item[1]["config"].get("workers") or 0):
        vals = [r for r in validations(data) if good(r["val/ppl"])]
        if not vals:
            continue
        label = f"N = {data['config'].get('workers')} ({run})"
        y = [r["val/ppl"] for r in vals]
        finite += y
        line, = by_step.plot([r["step"] for r in vals], y, label=label, linewidth=1.2)
        by_epoch.plot([r["epoch"] for r in vals], y, label=label, linewidth=1.2, color=line.get_color())
    for target in SPEEDUP_TARGETS:
        by_step.axhline(target, color="0.4", linestyle=":", linewidth=1.0)
        by_step.annotate(f"target {target:g}", (0.01, target), xycoords=("axes fraction", "data"), va="bottom",
                         fontsize="x-small", color="0.3")
    for ax in (by_step, by_epoch):
        if finite:
            low = min(finite + list(SPEEDUP_TARGETS))
            ax.set_ylim(low * 0.97, min(max(finite), 2.0 * low) * 1.02)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("validation perplexity (log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    by_step.set_xscale("log")
    by_step.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    by_step.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    by_step.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    by_step.set_xlabel("local steps per worker (log scale)")
    by_step.set_title("against steps: linear speed-up halves the steps when N doubles")
    by_epoch.set_xlabel("epochs (passes over the training set: equal samples for every N)")
    by_epoch.set_title("against samples")
    fig.suptitle(f"sweep {name}: validation perplexity (values above 2x the lowest leave the top)", fontsize="medium")
    from localclip.plot import save_figure

    return save_figure(fig, out)
