"""Figures of finished or running runs: loss and validation metric against epochs, rounds and
(modelled) wall-clock time, plus the clip fraction.

Wall-clock is modelled for a link of a given bandwidth and latency, so that runs made in
simulation show what a cluster would see: each record's time is the measured compute time (mean
over workers) plus, for every communication round so far, the latency, plus the bytes
communicated over the bandwidth.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from localclip import jsonio
from localclip.algorithms import ALGORITHMS
from localclip.errors import DataError, LocalclipError
from localclip.train.config import flat_view

__all__ = ["save_figure", "load_run", "modelled_seconds", "plot_runs"]


class PlotError(LocalclipError):
    """A folder that cannot be plotted, or runs that cannot share a figure."""


#: What the commands whose figures are optional say when matplotlib is missing.
NO_MATPLOTLIB = "no figure: it needs matplotlib (pip install 'localclip[plot]')"


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (``localclip[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def load_run(folder: str | Path) -> dict:
    """``{"config", "train", "eval", "label"}`` of one run folder (a run in progress works too)."""
    folder = Path(folder)
    config_path, metrics_path = folder / "config.json", folder / "metrics.jsonl"
    if not config_path.is_file() or not metrics_path.is_file():
        raise PlotError(f"{folder} is not a localclip run folder (no config.json and metrics.jsonl)")
    try:
        config = flat_view(jsonio.loads(config_path.read_text()))  # flat or in sections
        records = []
        for line in metrics_path.read_text().splitlines():
            try:
                records.append(jsonio.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of a run cut short may be partial
    except (OSError, json.JSONDecodeError) as exc:
        raise PlotError(f"{folder}: unreadable run files ({exc})") from exc
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if any(k.startswith("val/") for k in r)]
    # The final evaluation is the last point; one at the step of the last periodic one replaces it.
    evals = [r for i, r in enumerate(evals) if r.get("final") or not any(e.get("final") and e["step"] == r["step"] for e in evals[i + 1 :])]
    if not train:
        raise PlotError(f"{folder} has no training records yet")
    summary = {}
    if (folder / "summary.json").is_file():
        try:
            summary = jsonio.loads((folder / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
    diverged_at = summary.get("diverged_at_step")
    if diverged_at is None:  # a run that trained on (stop_on_divergence=false): its first diverged validation
        diverged_at = next((e["step"] for e in evals if any(isinstance(v, float) and not math.isfinite(v)
                                                          for k, v in e.items() if k.startswith("val/"))), None)
    algo = config.get("algorithm", "?")
    label = f"{algo} N={config.get('workers', '?')}"
    spec = ALGORITHMS.get(algo)
    if spec is not None and spec.averages_models:
        label += f" I={config.get('period', '?')}"
    if config.get("heterogeneous"):
        label += " hetero"
    if config.get("participants"):
        label += f" K={config['participants']}"
        if config.get("non_participants") == "idle":
            label += " idle"
    if config.get("momentum"):
        label += f" μ={config['momentum']}"
    if config.get("outer_optimizer", "none") != "none":
        label += f" outer={config['outer_optimizer']}"
    if config.get("compression", "none") != "none":
        label += f" {config['compression']}"
    return {"config": config, "train": train, "eval": evals, "label": label, "folder": str(folder), "diverged_at": diverged_at}


def modelled_seconds(record: dict, *, bandwidth: float, latency: float, compute: float | None = None) -> float:
    """Compute time plus ``rounds·latency + bytes·8/bandwidth`` (bandwidth in bit/s)."""
    compute = record.get("time/compute", 0.0) if compute is None else compute
    return compute + record.get("comm/rounds", 0) * latency + record.get("comm/bytes", 0) * 8.0 / bandwidth


def _with_compute(evals: list[dict], train: list[dict]) -> list[dict]:
    """Evaluation records carry no compute time: take the last training record's at that step."""
    out = []
    for e in evals:
        before = [t for t in train if t["step"] <= e["step"]]
        out.append({**e, "time/compute": before[-1]["time/compute"] if before else 0.0})
    return out


def _plain_log_axis(axis, ticker, *, minor_labels: bool) -> None:
    """Label a log axis 130, not 1.3×10²; minor ticks labelled too when the axis spans less than
    a decade (otherwise it would show one label or none)."""
    plain = ticker.FuncFormatter(lambda value, _pos: f"{value:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain if minor_labels else ticker.NullFormatter())


def _finite(value: float) -> float:
    """Infinite values (a diverged run's perplexity) as gaps: matplotlib cannot place them."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def plot_runs(folders: list[str], out: str | Path, *, labels: list[str] | None = None, bandwidth: float = 1e9,
              latency: float = 50e-6, title: str | None = None) -> Path:
    """Draw the runs in ``folders`` into ``out`` (PNG); ``labels`` name them in the legend (default:
    from each config, with the folder's name added where two would read the same)."""
    if not bandwidth > 0 or not latency >= 0:
        raise PlotError(f"Invalid link model: bandwidth {bandwidth} bit/s, latency {latency} s")
    if labels is not None and len(labels) != len(folders):
        raise PlotError(f"{len(labels)} labels for {len(folders)} runs")
    runs = [load_run(f) for f in folders]
    if labels is not None:
        for run, label in zip(runs, labels):
            run["label"] = label
    # Labels key the legend and the diverged runs: two runs must not share one.
    for name in (lambda run: Path(run["folder"]).name, lambda run: run["folder"]):
        seen = [run["label"] for run in runs]
        for run in runs:
            if seen.count(run["label"]) > 1:
                run["label"] += f" ({name(run)})"
    def metric(run):  # what its validation measures: perplexity (language models) or accuracy
        if run["eval"]:
            return "val/ppl" if "val/ppl" in run["eval"][0] else "val/acc"
        return "val/acc" if run["config"].get("task") == "image" else "val/ppl"

    metric_keys = {metric(r) for r in runs}
    if len(metric_keys) > 1:
        kinds = ", ".join(f"{r['folder']}: {metric(r)}" for r in runs)
        raise PlotError(f"runs with different metrics cannot share a figure ({kinds})")
    tasks = {r["config"].get("task") for r in runs}
    if len(tasks) > 1:
        raise PlotError(f"runs of different tasks cannot share a figure: {', '.join(r['folder'] + ': ' + str(r['config'].get('task')) for r in runs)}")
    val_key = next(iter(metric_keys))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker as ticker
    except ImportError:
        raise DataError("localclip plot needs matplotlib: pip install 'localclip[plot]'") from None

    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5), constrained_layout=True)
    xs = [("epoch", "epochs (passes over the training set)"), ("comm/rounds", "communication rounds (log scale)"),
          ("modelled", f"modelled wall-clock [s] ({bandwidth / 1e9:g} Gbit/s, {latency * 1e6:g} µs a round)")]
    task = next(iter(tasks))
    ylabels = {"train/loss": f"training loss [nats per {'token' if task == 'lm' else 'image'}]",
               "val/ppl": "validation perplexity (log scale)", "val/acc": "validation accuracy [fraction]"}
    # A run that never communicates (one worker) has no place on a rounds axis.
    silent = [run["label"] for run in runs if not any(r.get("comm/rounds", 0) >= 1 for r in run["train"] + run["eval"])]
    # Runs with one validation each (the final one, as after any --max-steps run): one panel shows them.
    one_eval = all(len(run["eval"]) <= 1 for run in runs)
    link = dict(bandwidth=bandwidth, latency=latency)
    # Lines that coincide (a compressed run beside its float32 twin) must both show: the earlier
    # runs are drawn wider and solid, the later ones narrower and dashed on top of them.
    styles = ["-", "--", "-.", ":"]
    for i, run in enumerate(runs):
        style = dict(linestyle=styles[i % len(styles)], linewidth=2.4 - 1.2 * min(i, len(runs) - 1) / max(1, len(runs) - 1))
        for row, (records, key) in enumerate(((run["train"], "train/loss"), (_with_compute(run["eval"], run["train"]), val_key))):
            if not records:
                continue
            for col, (xkey, _) in enumerate(xs):
                if row == 1 and one_eval and col > 0:
                    continue
                if xkey == "comm/rounds":
                    if run["label"] in silent:
                        axes[row][col].plot([], [], label=run["label"], **style)  # keeps the colours of the other panels
                        continue
                    records = [r for r in records if r.get("comm/rounds", 0) >= 1]
                x = [modelled_seconds(r, **link) if xkey == "modelled" else r.get(xkey, 0) for r in records]
                y = [_finite(r.get(key, math.nan)) for r in records]
                axes[row][col].plot(x, y, marker="o" if len(x) < 30 else None, markersize=4, label=run["label"], **style)
        axes[0][3].plot([r["epoch"] for r in run["train"]], [r.get("clip/fraction", math.nan) for r in run["train"]], label=run["label"], **style)
    # A diverged run (local SGD without clipping) would squash every other curve: the limits
    # fit the other runs, and a diverged one leaves the top of the panels (the legend says so).
    finals = [run["train"][-1].get("train/loss", math.nan) for run in runs]
    typical = sorted(v for v in finals if math.isfinite(v))
    middle = typical[len(typical) // 2] if typical else math.nan
    diverged = {run["label"] for run, v in zip(runs, finals) if not math.isfinite(v) or v > 1.5 * middle or run["diverged_at"] is not None
                or (run["eval"] and val_key == "val/ppl" and not math.isfinite(run["eval"][-1].get(val_key, math.nan)))}
    kept = [run for run in runs if run["label"] not in diverged] or runs
    limits = {}
    for key, records in (("train/loss", [r for run in kept for r in run["train"]]), (val_key, [r for run in kept for r in run["eval"]])):
        values = [v for r in records if math.isfinite(v := r.get(key, math.nan))]
        if values and key != "val/acc":
            low, high = min(values), max(values)
            if key == "val/ppl":
                # The curves enter from the top: the range is where they end, so that a gap of a
                # few per cent between the final perplexities is visible.
                ends = [v for run in kept if run["eval"] and math.isfinite(v := run["eval"][-1].get(key, math.nan))]
                if ends:
                    high = min(high, 1.6 * max(ends))
            if high == low:  # one value: give the line some room
                low, high = low * 0.95, high * 1.05
            limits[key] = (low / 1.05, high * 1.05) if key == "val/ppl" else (low - 0.03 * (high - low), high + 0.03 * (high - low))
    # The wall-clock panels span the runs that communicate: a single worker, N times slower per
    # epoch, would squeeze them to the left (its line leaves at the right edge; the legend says so).
    talking = [modelled_seconds(r, **link) for run in runs if run["label"] not in silent for r in run["train"]]
    right = max(talking) * 1.05 if talking and silent else None
    for row, key in enumerate(("train/loss", val_key)):
        for col, (xkey, xlabel) in enumerate(xs):
            ax = axes[row][col]
            if row == 1 and one_eval and col > 0:
                ax.axis("off")
                continue
            if key in limits:
                ax.set_ylim(*limits[key])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabels[key])
            if xkey == "comm/rounds":
                ax.set_xscale("log")
                ax.set_xlim(left=1)
                _plain_log_axis(ax.xaxis, ticker, minor_labels=False)
            if xkey == "modelled" and right is not None:
                ax.set_xlim(left=0, right=right)
            if key == "val/ppl":
                ax.set_yscale("log")
                low, high = ax.get_ylim()
                _plain_log_axis(ax.yaxis, ticker, minor_labels=high / low < 10)
            ax.grid(alpha=0.3)
            if key == "val/ppl":
                ax.yaxis.grid(True, which="minor", alpha=0.15)  # the labelled minor ticks of a short log axis
    if one_eval:
        axes[1][0].set_title("the final validation of each run (no validation before it)", fontsize="medium")
    # A value the panels cannot place (a diverged run's infinite perplexity) is written out.
    unplaced = [f"{run['label']}: final {val_key} = {v:g}" + (f" (diverged at step {run['diverged_at']})" if run["diverged_at"] is not None else "")
                for run in runs if run["eval"] and not math.isfinite(v := run["eval"][-1].get(val_key, math.nan))]
    if unplaced:
        axes[1][0].text(0.02, 0.98, "\n".join(unplaced), transform=axes[1][0].transAxes, va="top", fontsize="small",
                        bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
    axes[0][3].set_xlabel("epochs (passes over the training set)")
    axes[0][3].set_ylabel("fraction of steps clipped [0-1]")
    axes[0][3].set_ylim(-0.02, 1.02)
    axes[0][3].grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    at = {run["label"]: run["diverged_at"] for run in runs}
    beyond = {run["label"] for run in runs if run["label"] in silent and right is not None
              and max(modelled_seconds(r, **link) for r in run["train"]) > right}

    def note(label):
        notes = []
        if label in diverged:
            where = f" at step {at[label]}" if at.get(label) is not None else ""
            notes.append(f"diverged{where}" + (": above the top" if label not in {run["label"] for run in kept} else ""))
        if label in beyond:
            notes.append("wall-clock: beyond the right edge")
        return f"{label} ({'; '.join(notes)})" if notes else label

    labels = [note(label) for label in labels]
    axes[1][3].axis("off")
    title_note = f"not on the rounds panels (no communication): {', '.join(silent)}" if silent else None
    axes[1][3].legend(handles, labels, loc="center", fontsize="medium", title=title_note, title_fontsize="small")
    if title:
        fig.suptitle(title)
    return save_figure(fig, out)


def save_figure(fig, out: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``out`` through a temporary name (a reader never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(out)
    return out
