"""Sweeps: the named groups of runs behind the research questions, run one after another into
one folder and summarised as a table and a figure.

A sweep is a plain function ``(epochs) -> [(run_name, TrainConfig), ...]`` that derives every
run from a recipe with ``dataclasses.replace``; its default ``epochs`` is sized so that the whole
sweep takes about an hour of a 2-core CPU when it runs alone. Layout::

    ROOT/NAME/sweep.json    the planned runs and their status (rewritten atomically)
    ROOT/NAME/RUN/          one run folder per run (see :mod:`localclip.train.run_folder`)
    ROOT/NAME/summary.csv   written by :func:`report`, from finished runs only
    ROOT/NAME/summary.md
    ROOT/NAME/figure.png

:func:`run_sweep` skips finished runs (``summary.json``), resumes started ones from their latest
checkpoint and starts the rest, so an interrupted sweep is continued by running it again. It
owns no training logic: each run is one :func:`localclip.train.run_training` call. One sweep
process per sweep folder.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import os
import statistics
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from localclip.errors import Interrupted, LocalclipError
from localclip.recipes import get_recipe
from localclip.train import run_training
from localclip.train.config import TrainConfig, apply_overrides
from localclip.train.run_folder import RunFolder, atomic_write_text

__all__ = ["SWEEPS", "SweepError", "SweepFailed", "describe", "plan", "plan_lines", "report", "run_sweep", "sweep"]

Plan = list[tuple[str, TrainConfig]]

SWEEPS: dict[str, Callable[..., Plan]] = {}

# Worker-steps in one epoch (one pass of the whole system over the training set) of each recipe
# the sweeps use: PTB's 929,589 training tokens in b=5 columns of bptt 20, and Fashion-MNIST's
# 60,000 images in batches of 16. Only the logging and evaluation intervals are derived from
# them, so an estimate off by a few steps changes nothing but where a record falls.
WORKER_STEPS_PER_EPOCH = {"ptb-small": 9296, "fmnist-resnet": 3750}
LOGS_PER_EPOCH = 64

# The link that turns measured compute time and counted bytes into modelled wall-clock time.
BANDWIDTH = 1e9  # bit/s
LATENCY = 50e-6  # s per round


class SweepError(LocalclipError):
    """An unknown sweep or run name, or a sweep folder that cannot be reported."""


class SweepFailed(SweepError):
    """Some runs of a sweep failed; the others ran. ``failures`` maps run name to its error."""

    def __init__(self, name: str, failures: dict[str, str]):
        self.failures = dict(failures)
        detail = "; ".join(f"{run}: {error}" for run, error in failures.items())
        super().__init__(f"sweep {name}: {len(failures)} run(s) failed: {detail}")


def sweep(name: str):
    def register(fn):
        SWEEPS[name] = fn
        return fn

    return register


def plan(name: str, epochs: float | None = None, only: Sequence[str] | None = None) -> Plan:
    """The sweep's runs in the order they run; ``epochs`` overrides the sweep's default and
    ``only`` keeps the runs it names."""
    if name not in SWEEPS:
        raise SweepError(f"Unknown sweep {name!r}; available: {', '.join(SWEEPS)} (see `localclip sweep NAME --list`)")
    if epochs is not None and not (epochs > 0 and math.isfinite(epochs)):
        raise SweepError(f"Invalid epochs for sweep {name}: {epochs!r} (expected a finite number > 0)")
    runs = SWEEPS[name]() if epochs is None else SWEEPS[name](epochs)
    names = [run for run, _ in runs]
    assert len(set(names)) == len(names), f"sweep {name} repeats a run name: {names}"
    selected = _select(name, runs, only)
    return [(run, cfg) for run, cfg in runs if run in selected]


def describe() -> list[str]:
    return [f"{name:10s} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in SWEEPS.items()]


def _sized(cfg: TrainConfig, recipe: str, evals_per_epoch: int) -> TrainConfig:
    """Logging and evaluation intervals per epoch, whatever N: about ``evals_per_epoch``
    validations per epoch, at steps that end a communication period, so that every validation
    scores the averaged model (between rounds each worker would score its own columns with its
    own model). The intervals do not depend on ``epochs``, so a run resumed with other epochs
    keeps its config. A full PTB validation costs about as much as 250 worker-steps.
    """
    resolved = cfg.resolved()
    per_worker = max(1, WORKER_STEPS_PER_EPOCH[recipe] // resolved.workers)
    period = resolved.period if resolved.algorithm in ("celgc", "local-sgd") and resolved.workers > 1 else 1
    every = max(period, round(per_worker / evals_per_epoch / period) * period)
    return dataclasses.replace(cfg, eval_interval=every, log_interval=max(1, per_worker // LOGS_PER_EPOCH))


def _ptb(epochs: float, evals_per_epoch: int = 8, **changes) -> TrainConfig:
    return _sized(dataclasses.replace(get_recipe("ptb-small"), epochs=epochs, **changes), "ptb-small", evals_per_epoch)


def _fmnist(epochs: float, evals_per_epoch: int = 4, **changes) -> TrainConfig:
    return _sized(dataclasses.replace(get_recipe("fmnist-resnet"), epochs=epochs, **changes), "fmnist-resnet", evals_per_epoch)


@sweep("isweep")
def isweep(epochs: float = 0.5) -> Plan:
    """RQ1/RQ3 — ptb-small, N=8: CELGC with I = 2..64 against naive parallel clipping, local SGD and one worker.

    Same seed, η = 20 and γ = 5 everywhere; local SGD is CELGC without clipping (γ = ∞), I=8.

    Naive parallel clipping is CELGC's I=1 counterpart (gradients averaged every step); ``single``
    trains one worker on the whole corpus (an epoch is then 8x as many steps per worker). 9 runs
    of ``epochs`` epochs each (5,312 worker-steps per epoch), 8 validations per epoch so that the
    report can find when each run first reaches naive parallel's final perplexity.
    """
    runs = [(f"celgc-I{i}", _ptb(epochs, algorithm="celgc", workers=8, period=i)) for i in (2, 4, 8, 16, 32, 64)]
    runs.append(("naive", _ptb(epochs, algorithm="naive", workers=8, period=1)))
    runs.append(("local-sgd-I8", _ptb(epochs, algorithm="local-sgd", workers=8, period=8)))
    runs.append(("single", _ptb(epochs, algorithm="single", workers=1)))
    return runs


@sweep("speedup")
def speedup(epochs: float = 1.0) -> Plan:
    """RQ2 — ptb-small, CELGC I=8 with the per-worker batch b=5 fixed and N = 1, 2, 4, 8.

    N=1 is the ``single`` algorithm (one worker; CELGC with a world of one is the same).

    Every run passes over the corpus ``epochs`` times, so N workers take 1/N as many steps each;
    the report compares the steps per worker each needs to reach the same training loss and
    validation perplexity. 4 runs of ``epochs`` epochs each, 8 validations per epoch.
    """
    runs = [("single-N1", _ptb(epochs, algorithm="single", workers=1))]
    runs += [(f"celgc-N{n}-I8", _ptb(epochs, algorithm="celgc", workers=n, period=8)) for n in (2, 4, 8)]
    return runs


@sweep("scenarios")
def scenarios(epochs: float = 0.5) -> Plan:
    """RQ4 — ptb-small, N=8: CELGC against naive parallel clipping with heterogeneous data, K=4 of 8, momentum 0.9.

    * ``naive``: the homogeneous naive parallel baseline; it is also partial participation's
      baseline (the paper compares with full-participation naive parallel, and naive parallel
      clipping has no partial variant: it would ignore ``participants``).
    * Heterogeneous data on PTB means that worker r keeps shard r instead of taking shard
      (r + e) mod N in epoch e; epoch 0 is the same either way, so the two heterogeneous runs get
      ``epochs + 1`` epochs: one epoch as in every run, then ``epochs`` where the data differs
      (the report's epochs column says so).
    * Momentum 0.9 makes the effective step about 1/(1-0.9) = 10x longer, so both momentum runs
      scale ptb-small's η = 20 and γ = 5 by 0.1 (η = 2, γ = 0.5: the same clip norm γ/η = 0.25);
      ``celgc-I4-mom0`` keeps η = 20, γ = 5 without momentum.

    The final perplexities are what matter here, so 4 validations per epoch instead of 8.
    """
    base = get_recipe("ptb-small")
    lr, gamma = base.lr * 0.1, base.gamma * 0.1
    ptb = functools.partial(_ptb, evals_per_epoch=4, workers=8)
    return [
        ("naive", ptb(epochs, algorithm="naive", period=1)),
        ("celgc-I8-hetero", ptb(epochs + 1, algorithm="celgc", period=8, heterogeneous=True)),
        ("naive-hetero", ptb(epochs + 1, algorithm="naive", period=1, heterogeneous=True)),
        ("celgc-I8-K4", ptb(epochs, algorithm="celgc", period=8, participants=4)),
        ("celgc-I4-mom0.9-lr0.1x", ptb(epochs, algorithm="celgc", period=4, momentum=0.9, lr=lr, gamma=gamma)),
        ("naive-mom0.9-lr0.1x", ptb(epochs, algorithm="naive", period=1, momentum=0.9, lr=lr, gamma=gamma)),
        ("celgc-I4-mom0", ptb(epochs, algorithm="celgc", period=4)),
    ]


@sweep("image")
def image(epochs: float = 5.0) -> Plan:
    """RQ5 — Fashion-MNIST ResNet-8 (BatchNorm), N=8: CELGC I=8 against naive parallel clipping and local SGD.

    The ``fmnist-resnet`` recipe: b=16, η=0.1, γ=1, weight decay 5e-4, BatchNorm buffers averaged
    with the parameters; local SGD is CELGC with γ = ∞, I=8.

    3 runs of ``epochs`` epochs each (3,750 worker-steps per epoch), 4 validations per epoch.
    """
    return [
        ("celgc-I8", _fmnist(epochs, algorithm="celgc", workers=8, period=8)),
        ("naive", _fmnist(epochs, algorithm="naive", workers=8, period=1)),
        ("local-sgd-I8", _fmnist(epochs, algorithm="local-sgd", workers=8, period=8)),
    ]


# -- running ---------------------------------------------------------------------------------------


def _folder_state(folder: Path) -> str:
    run = RunFolder(folder)
    return "finished" if run.finished else "partial" if run.started else "pending"


def _write_status(path: Path, name: str, runs: Plan, selected: list[str], status: dict[str, dict], meta: dict) -> None:
    entries = []
    for run_name, cfg in runs:
        resolved = cfg.resolved()
        entry = {
            "name": run_name, "algorithm": resolved.algorithm, "workers": resolved.workers, "period": resolved.period,
            "epochs": resolved.epochs, "selected": run_name in selected, "status": _folder_state(path.parent / run_name),
        }
        entry.update(status.get(run_name, {}))
        entries.append(entry)
    doc = {"sweep": name, **meta, "runs": entries, "failed": [e["name"] for e in entries if e["status"] == "failed"]}
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def _select(name: str, runs: Plan, only: Sequence[str] | None) -> list[str]:
    names = [run for run, _ in runs]
    if not only:
        return names
    unknown = [run for run in only if run not in names]
    if unknown:
        raise SweepError(f"Unknown run(s) of sweep {name}: {', '.join(unknown)}; its runs: {', '.join(names)}")
    return [run for run in names if run in set(only)]


def run_sweep(
    name: str,
    root: str | os.PathLike,
    *,
    epochs: float | None = None,
    runtime: str = "simulate",
    data_root: str | None = None,
    only: Sequence[str] | None = None,
    progress: bool = False,
    max_steps: int | None = None,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
) -> dict[str, str]:
    """Run the sweep ``name`` into ``root/name``, one run after another; return each selected
    run's outcome (``skipped``, ``started``, ``resumed``).

    ``only`` restricts it to some runs; ``max_steps`` and ``overrides`` (``KEY=VALUE`` as with
    ``--set``) apply to every run (smoke tests). A run that fails is reported and the sweep goes
    on; :class:`SweepFailed` is raised at the end if any did. ``data_root`` is the config's: the
    corpora's folder for PTB, the IDX files' folder for Fashion-MNIST.
    """
    changes = {k: v for k, v in (("max_steps", max_steps), ("data_root", data_root)) if v is not None}
    # Every config as it will run, checked before anything is written (a bad override fails here).
    runs = [(run, apply_overrides(dataclasses.replace(cfg, **changes), list(overrides))) for run, cfg in plan(name, epochs)]
    for _, cfg in runs:
        cfg.resolved()
    selected = _select(name, runs, only)
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    status_path = folder / "sweep.json"
    meta = {"epochs": epochs, "runtime": runtime, "max_steps": max_steps, "overrides": list(overrides)}
    status: dict[str, dict] = {}
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    _write_status(status_path, name, runs, selected, status, meta)
    todo = [(run, cfg) for run, cfg in runs if run in selected]
    for index, (run_name, cfg) in enumerate(todo, 1):
        out = folder / run_name
        tag = f"[{index}/{len(todo)}] {name}/{run_name}"
        run = RunFolder(out)
        if run.finished:
            outcomes[run_name] = "skipped"
            note = _epochs_note(run, cfg)
            echo(f"{tag}: finished earlier, skipped{note}")
            continue
        resume = run.started
        outcomes[run_name] = "resumed" if resume else "started"
        echo(f"{tag}: {'resuming' if resume else 'starting'} ({_short(cfg)}) in {out}")
        status[run_name] = {"status": "running"}
        _write_status(status_path, name, runs, selected, status, meta)
        try:
            summary = run_training(cfg, out, runtime=runtime, resume=resume, progress=progress)
        except (KeyboardInterrupt, Interrupted):  # a stop request ends the sweep, not just this run
            status[run_name] = {"status": "interrupted"}
            _write_status(status_path, name, runs, selected, status, meta)
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the others
            error = str(exc) if isinstance(exc, LocalclipError) else f"{type(exc).__name__}: {exc}"
            failures[run_name] = error
            outcomes[run_name] = "failed"
            status[run_name] = {"status": "failed", "error": error}
            if not isinstance(exc, LocalclipError):
                status[run_name]["traceback"] = traceback.format_exc()
            echo(f"{tag}: FAILED: {error}")
        else:
            status.pop(run_name, None)
            echo(f"{tag}: done ({_result(summary)})")
        _write_status(status_path, name, runs, selected, status, meta)
    if failures:
        raise SweepFailed(name, failures)
    return outcomes


def _epochs_note(run: RunFolder, cfg: TrainConfig) -> str:
    try:
        done = json.loads(run.config_path.read_text()).get("epochs")
    except (OSError, json.JSONDecodeError):
        return ""
    if done != cfg.epochs:
        return f" (it ran {done} epochs, the plan now says {cfg.epochs}: delete {run.path} to redo it)"
    return ""


def _short(cfg: TrainConfig) -> str:
    r = cfg.resolved()
    period = "" if r.algorithm == "single" else f" I={1 if r.algorithm == 'naive' else r.period}"
    text = f"{r.algorithm} N={r.workers}{period} η={r.lr:g} γ={r.gamma:g} epochs={r.epochs:g}"
    if r.momentum:
        text += f" μ={r.momentum:g}"
    if r.heterogeneous:
        text += " heterogeneous"
    if r.participants:
        text += f" K={r.participants}"
    if r.max_steps:
        text += f" max_steps={r.max_steps}"
    return text


def _result(summary: dict | None) -> str:
    if not summary:
        return "no summary"
    keys = ("val/ppl", "test/ppl", "val/acc", "test/acc", "steps", "comm/rounds")
    return " ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys if k in summary)


def plan_lines(name: str, root: str | os.PathLike | None = None, epochs: float | None = None, only: Sequence[str] | None = None) -> list[str]:
    """One line per planned run (``--list``), with its folder's state when ``root`` is given."""
    lines = []
    for run_name, cfg in plan(name, epochs, only):
        state = f"  [{_folder_state(Path(root) / name / run_name)}]" if root is not None else ""
        lines.append(f"{run_name:24s} {_short(cfg)}{state}")
    return lines


# -- reporting -------------------------------------------------------------------------------------


def _records(folder: Path) -> list[dict]:
    out = []
    path = folder / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _good(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _reaches(value, target, lower: bool) -> bool:
    return _good(value) and (value <= target if lower else value >= target)


def _first(records: list[dict], key: str, target: float, lower: bool) -> dict | None:
    """The first record whose ``key`` is at or past ``target`` (records are in step order)."""
    return next((r for r in records if _reaches(r.get(key), target, lower)), None)


def _modelled(record: dict, train: list[dict]) -> float:
    """Modelled seconds at ``record``; an evaluation record takes the compute time of the last
    training record at or before its step (as the figure does)."""
    from localclip.plot import modelled_seconds

    if "time/compute" in record:
        return modelled_seconds(record, bandwidth=BANDWIDTH, latency=LATENCY)
    before = [t for t in train if t["step"] <= record["step"]]
    compute = before[-1].get("time/compute", 0.0) if before else 0.0
    return modelled_seconds(record, bandwidth=BANDWIDTH, latency=LATENCY, compute=compute)


def _load_finished(folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    records = _records(folder)
    train = [r for r in records if "train/loss" in r]
    return {"summary": summary, "config": config, "train": train, "val": [r for r in records if any(k.startswith("val/") for k in r)]}


def report(
    name: str,
    root: str | os.PathLike,
    *,
    loss_target: float | None = None,
    ppl_target: float | None = None,
    figure: bool = True,
) -> dict:
    """Summarise the finished runs of sweep ``name`` (only those with ``summary.json``) into
    ``summary.csv``, ``summary.md`` and ``figure.png`` in ``root/name``; return the table.

    ``speedup`` adds the steps per worker each run needs to first reach a training loss and a
    validation perplexity (default targets: the worst final value among its finished runs, so
    every run reaches them) and the ratio to N=1's; ``isweep`` adds the modelled time (measured
    compute plus a 1 Gbit/s, 50 µs link) each run needs to first reach naive parallel's final
    validation perplexity.
    """
    runs = plan(name)
    folder = Path(root) / name
    if not folder.is_dir():
        raise SweepError(f"No sweep folder {folder}: run `localclip sweep {name} --root {root}` first")
    names = [run for run, _ in runs]
    extra = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in names and (p / "summary.json").exists())
    finished = {run: _load_finished(folder / run) for run in names + extra if (folder / run / "summary.json").exists()}
    unfinished = [run for run in names if run not in finished]

    rows = []
    for run, data in finished.items():
        s, c = data["summary"], data["config"]
        metric = "ppl" if "val/ppl" in s else "acc"
        algorithm = c.get("algorithm")
        rows.append({
            "run": run,
            "algorithm": algorithm,
            "N": c.get("workers"),
            "I": c.get("period") if algorithm in ("celgc", "local-sgd") and c.get("workers", 1) > 1 else (1 if algorithm == "naive" else None),
            "epochs": s.get("epochs"),
            "steps": s.get("steps"),
            f"val/{metric}": s.get(f"val/{metric}"),
            f"test/{metric}": s.get(f"test/{metric}"),
            "comm/rounds": s.get("comm/rounds"),
            "comm/bytes": s.get("comm/bytes"),
            "modelled s": _modelled(data["train"][-1], data["train"]) if data["train"] else None,
        })

    targets: dict = {}
    notes: list[str] = []
    if name == "speedup":
        targets, note = _speedup_columns(rows, finished, loss_target, ppl_target)
        notes.append(note)
    elif name == "isweep":
        targets, note = _isweep_columns(rows, finished)
        notes.append(note)

    result = {
        "sweep": name, "folder": str(folder), "rows": rows, "finished": list(finished), "unfinished": unfinished,
        "targets": targets, "csv": str(folder / "summary.csv"), "markdown": str(folder / "summary.md"),
        "figure": None, "figure_error": None,
    }
    columns = list(dict.fromkeys(k for row in rows for k in row)) or ["run"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    atomic_write_text(folder / "summary.csv", buffer.getvalue())

    figure_path = folder / "figure.png"
    if figure and finished:
        from localclip.plot import plot_runs

        try:
            plot_runs([str(folder / run) for run in finished], figure_path, bandwidth=BANDWIDTH, latency=LATENCY, title=f"sweep {name}")
            result["figure"] = str(figure_path)
        except LocalclipError as exc:  # the tables are still worth having
            result["figure_error"] = str(exc)
    atomic_write_text(folder / "summary.md", _markdown(name, rows, columns, unfinished, notes, result))
    return result


def _speedup_columns(rows: list[dict], finished: dict, loss_target, ppl_target) -> tuple[dict, str]:
    finals_loss = [d["train"][-1]["train/loss"] for d in finished.values() if d["train"] and _good(d["train"][-1].get("train/loss"))]
    finals_ppl = [d["summary"].get("val/ppl") for d in finished.values() if _good(d["summary"].get("val/ppl"))]
    if loss_target is None and finals_loss:
        loss_target = max(finals_loss)
    if ppl_target is None and finals_ppl:
        ppl_target = max(finals_ppl)
    loss_key = f"steps to train/loss<={loss_target:.4g}" if loss_target is not None else "steps to train/loss"
    ppl_key = f"steps to val/ppl<={ppl_target:.4g}" if ppl_target is not None else "steps to val/ppl"
    for row in rows:
        data = finished[row["run"]]
        hit = _first(data["train"], "train/loss", loss_target, True) if loss_target is not None else None
        row[loss_key] = hit["step"] if hit else None
        hit = _first(data["val"], "val/ppl", ppl_target, True) if ppl_target is not None else None
        row[ppl_key] = hit["step"] if hit else None
    base = min(rows, key=lambda r: r["N"] or 0) if rows else None
    for row in rows:
        for key, label in ((loss_key, "speedup (train)"), (ppl_key, "speedup (val)")):
            row[label] = base[key] / row[key] if base and base.get(key) and row.get(key) else None
    note = (
        f"Steps are local steps per worker, to the first record at or below the target "
        f"(train/loss {loss_target if loss_target is not None else 'n/a'}, val/ppl {ppl_target if ppl_target is not None else 'n/a'}; "
        f"default: the worst final value among these runs); training loss is the mean over a logging interval. "
        f"Speedup: steps of the N={base['N'] if base else '?'} run over this run's; empty: not reached."
    )
    return {"train/loss": loss_target, "val/ppl": ppl_target}, note


def _isweep_columns(rows: list[dict], finished: dict) -> tuple[dict, str]:
    """Time to naive parallel's final val/ppl on the modelled link, twice: with each run's own
    measured compute, and with one compute time per step for all runs (the median over the
    sweep). Every run does the same computation per local step (same model, same batch), so the
    second keeps what the runs' algorithms differ in, steps and traffic, and drops the load the
    machine happened to carry while each ran."""
    naive = finished.get("naive")
    target = naive["summary"].get("val/ppl") if naive else None
    own, common, ratio = "modelled s to naive's val/ppl", "same as left, median compute/step", "naive's time / this (median compute/step)"
    from localclip.plot import modelled_seconds

    rates = [d["train"][-1]["time/compute"] / d["train"][-1]["step"] for d in finished.values() if d["train"] and d["train"][-1].get("step")]
    per_step = statistics.median(rates) if rates else None
    hits = {}
    for row in rows:
        if not _good(target):
            row[own] = row[common] = "naive not finished" if naive is None else "naive diverged"
            continue
        data = finished[row["run"]]
        hit = _first(data["val"], "val/ppl", target, True)
        row[own] = round(_modelled(hit, data["train"]), 3) if hit else "not reached"
        if hit and per_step is not None:
            hits[row["run"]] = modelled_seconds(hit, bandwidth=BANDWIDTH, latency=LATENCY, compute=hit["step"] * per_step)
        row[common] = round(hits[row["run"]], 3) if row["run"] in hits else "not reached"
    for row in rows:
        if "naive" in hits and row["run"] in hits:
            row[ratio] = round(hits["naive"] / hits[row["run"]], 3)
    note = (
        f"Modelled time: compute plus, per round, {LATENCY * 1e6:g} µs and the bytes at {BANDWIDTH / 1e9:g} Gbit/s, "
        f"at the first validation at or below naive parallel's final val/ppl ({target:.4g}); compute is each run's "
        f"own measured mean per worker, or (the last two columns) {per_step * 1e3:.3g} ms per local step for every "
        f"run, the median over these runs, which removes the machine's varying load from the comparison."
        if _good(target) and per_step is not None else "Naive parallel has no finished finite val/ppl yet: no time-to-target."
    )
    return {"val/ppl": target}, note


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _markdown(name: str, rows: list[dict], columns: list[str], unfinished: list[str], notes: list[str], result: dict) -> str:
    lines = [f"# Sweep `{name}`", ""]
    doc = (SWEEPS[name].__doc__ or "").strip().splitlines()
    if doc:
        lines += [doc[0], ""]
    if rows:
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(k)) for k in columns) + " |")
    else:
        lines.append("No finished runs yet.")
    lines.append("")
    lines += [f"{note}" for note in notes if note]
    lines.append(f"Steps are local steps per worker; comm/bytes is what one worker all-reduced; modelled s: "
                 f"compute plus a {BANDWIDTH / 1e9:g} Gbit/s, {LATENCY * 1e6:g} µs link.")
    if unfinished:
        lines.append(f"Not finished (left out): {', '.join(unfinished)}.")
    if result["figure"]:
        lines += ["", "![runs](figure.png)"]
    elif result["figure_error"]:
        lines.append(f"No figure: {result['figure_error']}")
    return "\n".join(lines) + "\n"
