"""Reporting a sweep: tables (``summary.csv``, ``summary.md``) and figures from its committed
run files (``config.json``, ``metrics.jsonl``, ``summary.json``), finished runs only.

Layout it writes::

    ROOT/NAME/summary.csv   one row per finished run, every column of every table
    ROOT/NAME/summary.md    the tables, with a note on how each column is computed
    ROOT/NAME/figure.png    loss and metric against epochs, rounds and modelled time (:mod:`localclip.plot`);
                            ``converge``: its main runs
    ROOT/NAME/figure-scenarios.png, figure-beyond.png
                            ``converge`` only: the scenario and beyond-the-paper runs beside their baselines
    ROOT/NAME/curves.png    ``converge`` only: validation perplexity per epoch, a panel per group

Nothing here trains or reads a checkpoint, so every number in a table can be recomputed from
the files a sweep commits.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

from localclip import jsonio
from localclip.algorithms.build import ALGORITHMS
from localclip.averaging.codecs import LOWBIT, encoded_nbytes
from localclip.errors import LocalclipError
from localclip_lab.reports import mechanism
from localclip_lab.plans import SWEEPS, SweepError, plan, report_kind
from localclip.train.run_folder import RESUME_MAY_CHANGE, atomic_write_text

__all__ = ["AWD_MESSAGE_BYTES", "BANDWIDTH", "LATENCY", "LINKS", "report"]

# The link that turns measured compute time and counted bytes into modelled wall-clock time.
BANDWIDTH = 1e9  # bit/s
LATENCY = 50e-6  # s per round
# converge: two links, and the message of the paper's AWD-LSTM (24M float32 parameters, 97 MB a round).
LINKS = {"1 Gbit/s": 1e9, "10 Gbit/s": 10e9}
AWD_MESSAGE_BYTES = 97e6
# What a compressed round sends, as a fraction of float32 (the 97 MB message shrinks with it);
# low-bit rounds: codes plus one float32 scale per block, for AWD-LSTM's message.
WIRE_FRACTION = {"none": 1.0, "bf16": 0.5, "fp16": 0.5,
                 **{name: encoded_nbytes(int(AWD_MESSAGE_BYTES) // 4, bits) / AWD_MESSAGE_BYTES for name, bits in LOWBIT.items()}}
# converge: the quality levels a user may settle for, as the naive baseline's final val/ppl
# times these factors (within 20 %, 10 %, 5 % of it, and it).
QUALITY_LEVELS = (1.2, 1.1, 1.05, 1.0)
# converge: the three comparisons a run can belong to, each with its own figure (file suffix).
CONVERGE_GROUPS = {"main runs": "", "scenarios": "-scenarios", "beyond the paper": "-beyond"}

def _records(folder: Path) -> list[dict]:
    out = []
    path = folder / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(jsonio.loads(line))
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
    summary = jsonio.loads((folder / "summary.json").read_text())
    config = jsonio.loads((folder / "config.json").read_text())
    records = _records(folder)
    train = [r for r in records if "train/loss" in r]
    return {"summary": summary, "config": config, "train": train, "val": [r for r in records if any(k.startswith("val/") for k in r)]}


def _period(config: dict) -> int | None:
    """The communication period a run's config.json describes (None: one worker, no rounds)."""
    spec = ALGORITHMS.get(config.get("algorithm"))
    if spec is None:
        return None
    return spec.period(SimpleNamespace(workers=config.get("workers", 1), period=config.get("period")))


def _row(run: str, data: dict) -> dict:
    s, c = data["summary"], data["config"]
    metric = "ppl" if "val/ppl" in s else "acc"
    algorithm = c.get("algorithm")
    # A run stopped where its validation found the model diverged (stop_on_divergence): its
    # steps and epochs are where it stopped, not its plan.
    diverged = {"diverged at step": s["diverged_at_step"]} if "diverged_at_step" in s else {}
    return {
        "run": run,
        "algorithm": algorithm,
        "N": c.get("workers"),
        "I": _period(c),
        "epochs": s.get("epochs"),
        "steps": s.get("steps"),
        **diverged,
        f"val/{metric}": s.get(f"val/{metric}"),
        f"test/{metric}": s.get(f"test/{metric}"),
        "comm/rounds": s.get("comm/rounds"),
        "comm/bytes": s.get("comm/bytes"),
        "modelled s": _modelled(data["train"][-1], data["train"]) if data["train"] else None,
    }


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
    validation perplexity; ``converge`` reports at convergence (see :func:`_converge_tables`)
    and draws ``curves.png``.
    """
    runs = plan(name)
    folder = Path(root) / name
    if not folder.is_dir():
        raise SweepError(f"No sweep folder {folder}: run `localclip sweep {name} --root {root}` first")
    names = [run for run, _ in runs]
    extra = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in names and (p / "summary.json").exists())
    finished = {}
    for run in names + extra:
        if (folder / run / "summary.json").exists():
            try:
                finished[run] = _load_finished(folder / run)
            except (OSError, json.JSONDecodeError) as exc:
                raise SweepError(f"{folder / run}: unreadable run files ({exc})") from exc
    unfinished = [run for run in names if run not in finished]

    rows = [_row(run, data) for run, data in finished.items()]
    targets: dict = {}
    notes: list[str] = []
    tables: list[tuple[str, list[str]]] = []
    kind = report_kind(name)
    if kind == "converge":
        targets, tables, note = _converge_tables(rows, finished)
        notes.append(note)
    elif kind in _COLUMNS:
        columns_of = functools.partial(_speedup_columns, loss_target=loss_target, ppl_target=ppl_target) if kind == "speedup" else _COLUMNS[kind]
        targets, note = columns_of(rows, finished)
        notes.append(note)

    result = {
        "sweep": name, "folder": str(folder), "rows": rows, "finished": list(finished), "unfinished": unfinished,
        "targets": targets, "csv": str(folder / "summary.csv"), "markdown": str(folder / "summary.md"),
        "figure": None, "figures": {}, "figure_error": None, "figure_note": None, "curves": None,
    }
    columns = list(dict.fromkeys(k for row in rows for k in row)) or ["run"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    atomic_write_text(folder / "summary.csv", buffer.getvalue())

    figure_path = folder / "figure.png"
    from localclip.plot import NO_MATPLOTLIB, have_matplotlib

    if figure and finished and not have_matplotlib():
        result["figure_note"] = NO_MATPLOTLIB  # the tables do not need it
    elif figure and finished:
        from localclip.plot import plot_runs

        # converge has too many runs for one readable figure: one per group, each run beside
        # the runs it is judged against.
        groups = _converge_groups(finished) if kind == "converge" else {"": list(finished)}
        try:
            for group, runs in groups.items():
                path = folder / f"figure{CONVERGE_GROUPS.get(group, '')}.png"
                plot_runs([str(folder / run) for run in runs], path, labels=runs, bandwidth=BANDWIDTH, latency=LATENCY,
                          title=f"sweep {name}" + (f": {group}" if group else ""))
                result["figures"][group] = path.name
            result["figure"] = str(figure_path) if "" in groups or "main runs" in groups else None
            if kind == "converge":
                result["curves"] = str(_converge_curves(finished, groups, folder / "curves.png", name))
            if kind == "speedup-converge":
                result["speedup_curves"] = str(_speedup_curves(finished, folder / "speedup.png", name))
        except LocalclipError as exc:  # the tables are still worth having
            result["figure_error"] = str(exc)
    if any(mechanism.has_statistics(data) for data in finished.values()):
        try:
            result["mechanism"] = mechanism.write_mechanism(finished, folder, f"sweep {name}")
        except ImportError as exc:  # the per-epoch table is written before the figure
            result["figure_error"] = result["figure_error"] or f"mechanism.png needs matplotlib ({exc})"
    atomic_write_text(folder / "summary.md", _markdown(name, rows, tables or [("", columns)], unfinished, notes, result))
    return result


def _tune_columns(rows: list[dict], finished: dict) -> tuple[dict, str]:
    """tune-gamma: each run's γ and clip norm, its last epoch's clipping, and each side's best γ."""
    best: dict = {}
    for row in rows:
        data = finished[row["run"]]
        config = data["config"]
        row["γ"] = config.get("gamma")
        row["clip norm γ/η"] = config["gamma"] / config["lr"] if config.get("gamma") and config.get("lr") else None
        last = [r for r in data["train"] if r.get("epoch", 0) > (data["summary"].get("epochs") or 0) - 1]
        for key, column in (("clip/fraction", "clipped (last epoch)"), ("clip/local_fraction", "local > γ/η (last epoch)")):
            values = [r[key] for r in last if _good(r.get(key))]
            row[column] = sum(values) / len(values) if values else None
        side = row["algorithm"]
        if _good(row.get("val/ppl")) and (side not in best or row["val/ppl"] < best[side]["val/ppl"]):
            best[side] = row
    for row in rows:
        row["best for its side"] = "yes" if best.get(row["algorithm"]) is row else ""
    chosen = {side: row["γ"] for side, row in best.items()}
    note = ("Each side gets the same grid and one run per γ of the same length; a side's best γ is the one with "
            "the lower final validation perplexity (at the end of the compressed schedule). Best: "
            + ", ".join(f"{side} γ = {gamma:g}" for side, gamma in chosen.items()) + ".")
    return {"best_gamma": chosen}, note


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


def _speedup_end_columns(rows: list[dict], finished: dict) -> tuple[dict, str]:
    """speedup-converge: validation at a few whole epochs (equal samples for every N), and per
    target of ``SPEEDUP_TARGETS`` the local steps each run needs to reach it, the speed-up over
    the smallest N (its steps over this run's) and that speed-up's share of linear (speed-up
    divided by the ratio of the workers)."""
    from localclip_lab.plans import SPEEDUP_TARGETS

    base = min(rows, key=lambda r: r["N"] or 0) if rows else None
    ends = {row["run"]: _epoch_ends(finished[row["run"]]) for row in rows}
    last = max((max(e) for e in ends.values() if e), default=0)
    checkpoints = sorted({e for e in (1, last // 3, 2 * last // 3, last) if e >= 1})
    for row in rows:
        for epoch in checkpoints:
            row[f"val/ppl epoch {epoch}"] = ends[row["run"]].get(epoch)
        for target in SPEEDUP_TARGETS:
            hit = _first(_vals(finished[row["run"]]), "val/ppl", target, True)
            row[f"steps to {target:g}"] = hit["step"] if hit else None
    for row in rows:
        for target in SPEEDUP_TARGETS:
            key, mine = f"steps to {target:g}", row[f"steps to {target:g}"]
            theirs = base.get(key) if base else None
            speedup = theirs / mine if theirs and mine else None
            row[f"speed-up to {target:g}"] = speedup
            row[f"of linear to {target:g}"] = speedup / (row["N"] / base["N"]) if speedup and row["N"] and base["N"] else None
    note = (f"Steps are local steps per worker to the first validation at or below each target; speed-up: the "
            f"N = {base['N'] if base else '?'} run's steps over this run's; of linear: that speed-up over the ratio "
            f"of workers; empty: not reached. Every run sees the same samples per epoch.")
    return {"val/ppl": list(SPEEDUP_TARGETS)}, note


def _regime_columns(rows: list[dict], finished: dict) -> tuple[dict, str]:
    """regime: how often the algorithm clipped, how often a worker's own gradient and the
    workers' mean gradient exceed the clip norm γ/η, and both norms as multiples of it (medians
    over the logged intervals; the mean gradient is sampled once per interval)."""
    verdicts = {}
    for row in rows:
        records = [r for r in finished[row["run"]]["train"] if _good(r.get("gamma")) and _good(r.get("lr")) and r["lr"] > 0]
        norms = [r["gamma"] / r["lr"] for r in records]
        row["clip norm γ/η"] = statistics.median(norms) if norms else None
        for key, column in (("clip/fraction", "clipped by the algorithm"), ("clip/local_fraction", "own gradient > γ/η")):
            values = [r[key] for r in records if _good(r.get(key))]
            row[column] = sum(values) / len(values) if values else None
        for key, column in (("grad/mean_norm", "mean gradient"), ("grad/local_norm", "own gradient")):
            ratios = [r[key] / clip for r, clip in zip(records, norms) if _good(r.get(key)) and clip > 0]
            row[f"{column} / γ/η (median)"] = statistics.median(ratios) if ratios else None
            if key == "grad/mean_norm":
                row["intervals with the mean gradient > γ/η"] = sum(x > 1 for x in ratios) / len(ratios) if ratios else None
        if row["algorithm"] == "naive" and row["clipped by the algorithm"] is not None:
            verdicts[row["run"]] = row["clipped by the algorithm"]
    said = "; ".join(f"{run} clipped {share:.1%} of its steps" for run, share in verdicts.items())
    note = ("Naive parallel clipping clips the workers' mean gradient, so its clip fraction says how often that mean "
            "exceeds γ/η; \"own gradient > γ/η\" is how often one worker's gradient does, which is what CELGC clips. "
            + (said[0].upper() + said[1:] + "." if said else ""))
    return {"clipped": verdicts}, note


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


#: The report kinds that add columns to the one table (``converge`` builds tables of its own).
_COLUMNS = {
    "speedup": _speedup_columns,
    "isweep": _isweep_columns,
    "tune-gamma": _tune_columns,
    "speedup-converge": _speedup_end_columns,
    "regime": _regime_columns,
}


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


# -- converge --------------------------------------------------------------------------------------


def _vals(data: dict) -> list[dict]:
    """Validation records in step order, the final one (a repeat of the last) left out."""
    return [r for r in data["val"] if "val/ppl" in r and not r.get("final")]


def _best(data: dict) -> dict | None:
    """The validation record with the lowest finite perplexity, the final one included (the
    earliest of equals), or None."""
    records = [r for r in data["val"] if "val/ppl" in r and _good(r["val/ppl"])]
    return min(records, key=lambda r: r["val/ppl"]) if records else None


def _epoch_ends(data: dict) -> dict[int, float]:
    """Validation perplexity at the end of each whole epoch (the record whose epoch is k.0)."""
    ends = {}
    for r in _vals(data):
        epoch = r.get("epoch")
        if isinstance(epoch, (int, float)) and round(epoch) >= 1 and abs(epoch - round(epoch)) < 1e-6:
            ends[round(epoch)] = r["val/ppl"]
    return ends


def _baseline(run: str, data: dict, finished: dict) -> str | None:
    """The naive parallel run this run is judged against: same length, seed, data split and
    momentum. A run longer than every such naive run (CELGC given more epochs, to compare at
    equal time) is judged against the longest shorter one."""
    key = ("seed", "heterogeneous", "momentum")
    naive = {other: d["config"] for other, d in finished.items()
             if d["config"].get("algorithm") == "naive" and all(d["config"].get(k) == data["config"].get(k) for k in key)}
    epochs = data["config"].get("epochs") or 0
    same = [other for other, c in naive.items() if c.get("epochs") == epochs]
    if same:
        return same[0]
    shorter = [other for other, c in naive.items() if (c.get("epochs") or 0) < epochs]
    return max(shorter, key=lambda other: naive[other].get("epochs") or 0) if shorter else None


def _group(config: dict) -> str:
    """Which comparison a converge run belongs to (a key of ``CONVERGE_GROUPS``)."""
    streaming = config.get("fragments", 1) != 1 or config.get("overlap", 0)
    if config.get("outer_optimizer", "none") != "none" or config.get("compression", "none") != "none" or config.get("algorithm") == "episode" or streaming:
        return "beyond the paper"
    if config.get("heterogeneous") or config.get("participants") or config.get("momentum"):
        return "scenarios"
    return "main runs"


def _plain(run: str, data: dict, finished: dict) -> str | None:
    """A beyond-the-paper run's plain CELGC counterpart: same period, length, seed, data split,
    participation, momentum, lr and γ, with plain averaging and blocking whole-model float32 rounds."""
    if _group(data["config"]) != "beyond the paper":
        return None
    key = ("period", "epochs", "seed", "heterogeneous", "participants", "momentum", "lr", "gamma")
    matches = [other for other, d in finished.items()
               if d["config"].get("algorithm") == "celgc" and _group(d["config"]) != "beyond the paper"
               and all(d["config"].get(k) == data["config"].get(k) for k in key)]
    return matches[0] if matches else None


def _converge_groups(finished: dict) -> dict[str, list[str]]:
    """The runs of each group that has any, in sweep order; a scenario or beyond-the-paper run
    brings its naive baseline and its plain counterpart along, to be compared in the figure."""
    groups: dict[str, list[str]] = {}
    for run, data in finished.items():
        group = _group(data["config"])
        members = groups.setdefault(group, [])
        along = () if group == "main runs" else (_baseline(run, data, finished), _plain(run, data, finished))
        for member in (*along, run):  # a naive run is its own baseline: add it once
            if member and member not in members:
                members.append(member)
    return {group: groups[group] for group in CONVERGE_GROUPS if group in groups}


def _converge_tables(rows: list[dict], finished: dict) -> tuple[dict, list, str]:
    """Per run: final perplexities and their noise (spread over the last three validations),
    rounds and rounds per epoch, bytes, the gain of the last two epochs; and the modelled time
    to reach the final perplexity of its naive baseline (:func:`_baseline`) on a 1 and a
    10 Gbit/s link, with this model's message and with AWD-LSTM's 97 MB one.

    Every run computes the same per local step (same model, same batch), so the time uses one
    compute time per step for all runs, the median over the sweep: that keeps what the
    algorithms differ in (steps to the target, rounds, bytes) and drops the load the machine
    happened to carry while each ran (the runs share a 2-core machine).
    """
    rates = [d["train"][-1]["time/compute"] / d["train"][-1]["step"] for d in finished.values() if d["train"] and d["train"][-1].get("step")]
    per_step = statistics.median(rates) if rates else None
    times = {}
    for row in rows:
        data = finished[row["run"]]
        c = data["config"]
        vals = [r["val/ppl"] for r in _vals(data)]
        last = vals[-3:]
        row["seed"] = c.get("seed")
        row["dropout"] = (c.get("model_options") or {}).get("dropout")
        row["spread last 3 val"] = (max(last) - min(last)) if len(last) == 3 and all(_good(v) for v in last) else None
        epochs = row["epochs"] or 0
        row["rounds/epoch"] = row["comm/rounds"] / epochs if row["comm/rounds"] is not None and epochs else None
        row["MB sent"] = row["comm/bytes"] / 1e6 if row["comm/bytes"] is not None else None
        ends = _epoch_ends(data)
        if ends and max(ends) - 2 in ends and _good(ends[max(ends)]) and _good(ends[max(ends) - 2]):
            e = max(ends)
            row["gain last 2 epochs %"] = 100 * (ends[e - 2] - ends[e]) / ends[e - 2]
        else:
            row["gain last 2 epochs %"] = None
        base = _baseline(row["run"], data, finished)
        row["group"] = _group(c)
        row["baseline"] = base
        target = finished[base]["summary"].get("val/ppl") if base else None
        row["vs naive %"] = _percent(row.get("val/ppl"), target)
        best = _best(data)
        row["best val/ppl"] = best["val/ppl"] if best else None
        row["best at epoch"] = best.get("epoch") if best else None
        base_best = _best(finished[base]) if base else None
        row["best vs naive best %"] = _percent(row["best val/ppl"], base_best["val/ppl"] if base_best else None)
        plain = _plain(row["run"], data, finished)
        row["plain CELGC"] = plain
        row["vs plain %"] = _percent(row.get("val/ppl"), finished[plain]["summary"].get("val/ppl") if plain else None)
        # A round of P fragments carries 1/P of the model (fragments are equal element ranges).
        message = AWD_MESSAGE_BYTES * WIRE_FRACTION.get(c.get("compression", "none"), 1.0) / (c.get("fragments") or 1)
        overlap = c.get("overlap") or 0
        row["target val/ppl"] = target
        hit = _first(data["val"], "val/ppl", target, True) if _good(target) else None
        row["steps to target"] = hit["step"] if hit else None
        row["rounds to target"] = hit.get("comm/rounds") if hit else None
        for link, bandwidth in LINKS.items():
            for wire, label in ((None, ""), (message, ", 97 MB")):
                col = f"s to target {link}{label}"
                row[col] = _seconds(hit, per_step, bandwidth, wire, overlap)
                if row[col] is not None:
                    times[(row["run"], col)] = row[col]
        # The converse question: how long the baseline takes to reach what this run reaches.
        own = data["summary"].get("val/ppl")
        own_hit = _first(data["val"], "val/ppl", own, True) if _good(own) else None
        base_hit = _first(finished[base]["val"], "val/ppl", own, True) if base and _good(own) else None
        row["own final val/ppl"] = own
        row["naive steps to it"] = base_hit["step"] if base_hit else None
        row["steps to it"] = own_hit["step"] if own_hit else None
        for link, bandwidth in LINKS.items():
            mine = _seconds(own_hit, per_step, bandwidth, message, overlap)
            theirs = _seconds(base_hit, per_step, bandwidth, AWD_MESSAGE_BYTES)
            row[f"naive s to it {link}, 97 MB"] = theirs
            row[f"s to it {link}, 97 MB"] = mine
            row[f"naive/this to it {link}, 97 MB"] = theirs / mine if theirs and mine else None
        for factor in QUALITY_LEVELS:
            level = target * factor if _good(target) else None
            level_hit = _first(data["val"], "val/ppl", level, True) if level is not None else None
            for link, bandwidth in LINKS.items():
                row[f"s to naive{_level(factor)} {link}"] = _seconds(level_hit, per_step, bandwidth, message, overlap)
                row[f"s to naive{_level(factor)} {link}, own size"] = _seconds(level_hit, per_step, bandwidth, None, overlap)
    for row in rows:
        for link in LINKS:
            col = f"s to target {link}, 97 MB"
            base = times.get((row["baseline"], col))
            own = times.get((row["run"], col))
            row[f"naive/this {link}, 97 MB"] = base / own if base and own else None
    stopped = ["diverged at step"] if any("diverged at step" in row for row in rows) else []
    main = ["run", "group", "algorithm", "N", "I", "seed", "dropout", "epochs", "steps", *stopped, "val/ppl", "test/ppl", "spread last 3 val",
            "gain last 2 epochs %", "vs naive %", "best val/ppl", "best at epoch", "best vs naive best %", "plain CELGC", "vs plain %",
            "comm/rounds", "rounds/epoch", "MB sent"]
    timing = ["run", "baseline", "target val/ppl", "steps to target", "rounds to target"]
    timing += [f"s to target {link}{label}" for link in LINKS for label in ("", ", 97 MB")]
    timing += [f"naive/this {link}, 97 MB" for link in LINKS]
    converse = ["run", "baseline", "own final val/ppl", "naive steps to it", "steps to it"]
    converse += [f"{who}s to it {link}, 97 MB" for link in LINKS for who in ("naive ", "")]
    converse += [f"naive/this to it {link}, 97 MB" for link in LINKS]
    levels = ["run", "baseline", "target val/ppl"]
    levels += [f"s to naive{_level(factor)} {link}" for factor in QUALITY_LEVELS for link in LINKS]
    own_levels = ["run", "baseline", "target val/ppl"]
    own_levels += [f"s to naive{_level(factor)} {link}, own size" for factor in QUALITY_LEVELS for link in LINKS]
    note = (
        ("diverged at step: the run stopped at the validation that found its model diverged (stop_on_divergence); "
         "its epochs and steps are where it stopped. " if stopped else "")
        + "spread last 3 val: largest minus smallest of the last three validation perplexities (the evaluation noise); "
        "gain last 2 epochs: how much val/ppl fell from the end of epoch E-2 to the end of the last epoch E, in % "
        "(under 1 %: a plateau). Rounds count only collectives that carry something the workers do not already share. "
        "Time to target: the first validation at or below the baseline's final val/ppl (baseline: the naive parallel run "
        "with the same epochs, seed, data split and momentum); modelled seconds = steps × "
        + (f"{per_step * 1e3:.3g} ms" if per_step else "?")
        + f" (the median measured compute per local step over these runs) + rounds × {LATENCY * 1e6:g} µs + bytes over the link; "
        "'97 MB': every round carries AWD-LSTM's 97 MB message instead of this model's (48.5 MB with bf16 or fp16 rounds, "
        "int8/int4 their share of it, 1/P of it with P fragments); a round in flight for τ steps (overlap) costs only what "
        "of its time exceeds τ steps of compute. "
        "best val/ppl: the lowest validation perplexity of the run's evaluations (the final one included) and the epoch "
        "where it fell; best vs naive best %: that above the naive baseline's own best (each side read at its best). "
        "vs naive %, vs plain %: this run's final val/ppl above its naive baseline's, and above its plain CELGC counterpart's "
        "(same period, plain averaging, float32 rounds; for EPISODE the CELGC run on the same data). naive/this: the baseline's time over "
        "this run's (above 1: this run is faster); empty where a run does not reach the target. "
        "Time to this run's final perplexity: the same model, the other way round: when this run first reaches its own "
        "final val/ppl, and when its naive baseline first reaches that value (97 MB rounds). "
        "Time to each quality level: the same modelled seconds (97 MB rounds) to the first validation within "
        + ", ".join(f"{100 * (f - 1):g} %" for f in QUALITY_LEVELS if f > 1)
        + " of the baseline's final val/ppl, and to that value itself (naive+0 %); the same again with each round "
        "carrying this model's own message (the bytes the run sent), where compute weighs more against the link."
    )
    tables = [("Runs", main), ("Time to the naive baseline's final perplexity", timing),
              ("Time to this run's final perplexity", converse), ("Time to each quality level, 97 MB rounds", levels),
              ("Time to each quality level, this model's rounds", own_levels)]
    seeds = _seed_families(rows, finished)
    return {"per_step_compute": per_step, "seeds": seeds}, tables, note + _seed_markdown(seeds)


# Config fields that do not say what a run computes: the seed (what a family varies), and how a
# run is observed and hosted. stop_check_interval is one of the latter and was added after the
# first runs were written, so without this an old run and a newer one would never make a family.
_NOT_THE_RUN = frozenset({"seed"}) | (RESUME_MAY_CHANGE - {"max_steps", "epochs"})


def _seed_families(rows: list[dict], finished: dict) -> list[dict]:
    """Runs that differ only in their seed, one family each (those run at two seeds or more):
    the seed-to-seed range of the final val/ppl, and of the gap to each seed's own naive run,
    which is how much of a difference between two runs the seed alone can make."""
    families: dict[str, list[dict]] = {}
    for row in rows:
        config = {k: v for k, v in finished[row["run"]]["config"].items() if k not in _NOT_THE_RUN}
        families.setdefault(json.dumps(config, sort_keys=True, default=str), []).append(row)
    out = []
    for members in families.values():
        finals = [r.get("val/ppl") for r in members]
        if len(members) < 2 or not all(_good(v) for v in finals):
            continue
        gaps = [r.get("vs naive %") for r in members]
        mean = statistics.fmean(finals)
        out.append({
            "runs": [r["run"] for r in members], "seeds": [r.get("seed") for r in members], "val/ppl": finals,
            "mean val/ppl": mean, "range % of mean": 100 * (max(finals) - min(finals)) / mean,
            "vs naive %": gaps if all(g is not None for g in gaps) else None,
        })
    return out


def _seed_markdown(seeds: list[dict]) -> str:
    if not seeds:
        return ""
    lines = ["", "", "## Seeds", "",
             "Runs that differ only in their seed. vs naive %: each seed's gap to the naive run with the same seed.", "",
             "| runs | seeds | val/ppl | mean | range % of mean | vs naive % |", "|---|---|---|---|---|---|"]
    for f in seeds:
        gaps = ", ".join(_cell(g) for g in f["vs naive %"]) if f["vs naive %"] else ""
        lines.append(f"| {', '.join(f['runs'])} | {', '.join(str(s) for s in f['seeds'])} | "
                     f"{', '.join(_cell(v) for v in f['val/ppl'])} | {_cell(f['mean val/ppl'])} | {_cell(f['range % of mean'])} | {gaps} |")
    return "\n".join(lines) + "\n"  # a blank line ends the table


def _percent(value, reference) -> float | None:
    """How far ``value`` is above ``reference``, in % of it."""
    return 100 * (value - reference) / reference if _good(value) and _good(reference) and reference else None


def _level(factor: float) -> str:
    return f"+{100 * (factor - 1):.0f} %"


def _seconds(hit: dict | None, per_step: float | None, bandwidth: float, message: float | None, overlap: int = 0) -> float | None:
    """Modelled seconds to the record ``hit``: compute per local step, and per round a latency and
    its bytes over a link of ``bandwidth`` bit/s (``message`` bytes a round, or the bytes the run
    counted when None). A round in flight for ``overlap`` steps (streaming rounds) costs only what
    of its time exceeds that much compute."""
    if hit is None or per_step is None:
        return None
    rounds = hit.get("comm/rounds", 0)
    nbytes = hit.get("comm/bytes", 0) if message is None else rounds * message
    if overlap and rounds:
        return hit["step"] * per_step + rounds * max(0.0, LATENCY + nbytes * 8 / bandwidth / rounds - overlap * per_step)
    return hit["step"] * per_step + rounds * LATENCY + nbytes * 8 / bandwidth


def _converge_curves(finished: dict, groups: dict[str, list[str]], out: Path, name: str = "converge") -> Path:
    """Validation perplexity per epoch, a panel per group of :func:`_converge_groups`."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(7.5 * len(groups), 5.2), constrained_layout=True, squeeze=False)
    for ax, (title, runs) in zip(axes[0], groups.items()):
        finite = []
        for run in runs:
            vals = _vals(finished[run])
            x = [r["epoch"] for r in vals]
            y = [r["val/ppl"] if _good(r["val/ppl"]) else math.nan for r in vals]
            finite += [v for v in y if math.isfinite(v)]
            diverged = not _good(finished[run]["summary"].get("val/ppl"))
            ends = _epoch_ends(finished[run])
            line, = ax.plot(x, y, label=run + (" (diverged)" if diverged else ""), linewidth=1.2)
            ax.plot(list(ends), [v if _good(v) else math.nan for v in ends.values()], "o", markersize=3, color=line.get_color())
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


def _speedup_curves(finished: dict, out: Path, name: str) -> Path:
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
        vals = [r for r in _vals(data) if _good(r["val/ppl"])]
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


def _markdown(name: str, rows: list[dict], tables: list[tuple[str, list[str]]], unfinished: list[str], notes: list[str], result: dict) -> str:
    lines = [f"# Sweep `{name}`", ""]
    doc = (SWEEPS[name].__doc__ or "").strip().splitlines()
    if doc:
        lines += [doc[0], ""]
    if not rows:
        lines += ["No finished runs yet.", ""]
    for title, columns in tables if rows else []:
        if title:
            lines += [f"## {title}", ""]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(k)) for k in columns) + " |")
        lines.append("")
    lines += [f"{note}" for note in notes if note]
    lines.append(f"Steps are local steps per worker; comm/bytes is what one worker all-reduced; modelled s: "
                 f"compute plus a {BANDWIDTH / 1e9:g} Gbit/s, {LATENCY * 1e6:g} µs link.")
    if unfinished:
        lines.append(f"Not finished (left out): {', '.join(unfinished)}.")
    for group, path in result["figures"].items():
        lines += ["", f"![{group or 'runs'}]({path})"]
    if result.get("curves"):
        lines += ["", "![validation perplexity per epoch](curves.png)"]
    if result.get("speedup_curves"):
        lines += ["", "![validation perplexity against local steps per worker, and per epoch](speedup.png)"]
    if result.get("mechanism"):
        lines += ["", "Per epoch: gradient norms, clip fractions, step lengths and how far the averaged model moved "
                  "(`mechanism.csv`; see `localclip_lab.reports.mechanism`).", "", "![mechanism](mechanism.png)"]
    if result["figure_error"]:
        lines.append(f"No figure: {result['figure_error']}")
    return "\n".join(lines) + "\n"
