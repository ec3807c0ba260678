"""The report kinds that add columns to a sweep's one table: ``speedup``, ``isweep``,
``tune-gamma``, ``speedup-converge`` and ``regime`` (:data:`COLUMNS`; ``converge`` has tables of
its own, :mod:`localclip_lab.reports.converge`).

Each takes the table's rows and the finished runs, adds its columns to the rows, and returns
what it found (its targets) and a note on how its columns are computed.
"""

from __future__ import annotations

import statistics

from localclip_lab.reports.link import BANDWIDTH, LATENCY, modelled_at
from localclip_lab.reports.runs import epoch_ends, first, good, validations

__all__ = ["COLUMNS"]


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
            values = [r[key] for r in last if good(r.get(key))]
            row[column] = sum(values) / len(values) if values else None
        side = row["algorithm"]
        if good(row.get("val/ppl")) and (side not in best or row["val/ppl"] < best[side]["val/ppl"]):
            best[side] = row
    for row in rows:
        row["best for its side"] = "yes" if best.get(row["algorithm"]) is row else ""
    chosen = {side: row["γ"] for side, row in best.items()}
    note = ("Each side gets the same grid and one run per γ of the same length; a side's best γ is the one with "
            "the lower final validation perplexity (at the end of the compressed schedule). Best: "
            + ", ".join(f"{side} γ = {gamma:g}" for side, gamma in chosen.items()) + ".")
    return {"best_gamma": chosen}, note


def _speedup_columns(rows: list[dict], finished: dict, loss_target, ppl_target) -> tuple[dict, str]:
    finals_loss = [d["train"][-1]["train/loss"] for d in finished.values() if d["train"] and good(d["train"][-1].get("train/loss"))]
    finals_ppl = [d["summary"].get("val/ppl") for d in finished.values() if good(d["summary"].get("val/ppl"))]
    if loss_target is None and finals_loss:
        loss_target = max(finals_loss)
    if ppl_target is None and finals_ppl:
        ppl_target = max(finals_ppl)
    loss_key = f"steps to train/loss<={loss_target:.4g}" if loss_target is not None else "steps to train/loss"
    ppl_key = f"steps to val/ppl<={ppl_target:.4g}" if ppl_target is not None else "steps to val/ppl"
    for row in rows:
        data = finished[row["run"]]
        hit = first(data["train"], "train/loss", loss_target, True) if loss_target is not None else None
        row[loss_key] = hit["step"] if hit else None
        hit = first(data["val"], "val/ppl", ppl_target, True) if ppl_target is not None else None
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
    ends = {row["run"]: epoch_ends(finished[row["run"]]) for row in rows}
    last = max((max(e) for e in ends.values() if e), default=0)
    checkpoints = sorted({e for e in (1, last // 3, 2 * last // 3, last) if e >= 1})
    for row in rows:
        for epoch in checkpoints:
            row[f"val/ppl epoch {epoch}"] = ends[row["run"]].get(epoch)
        for target in SPEEDUP_TARGETS:
            hit = first(validations(finished[row["run"]]), "val/ppl", target, True)
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
        records = [r for r in finished[row["run"]]["train"] if good(r.get("gamma")) and good(r.get("lr")) and r["lr"] > 0]
        norms = [r["gamma"] / r["lr"] for r in records]
        row["clip norm γ/η"] = statistics.median(norms) if norms else None
        for key, column in (("clip/fraction", "clipped by the algorithm"), ("clip/local_fraction", "own gradient > γ/η")):
            values = [r[key] for r in records if good(r.get(key))]
            row[column] = sum(values) / len(values) if values else None
        for key, column in (("grad/mean_norm", "mean gradient"), ("grad/local_norm", "own gradient")):
            ratios = [r[key] / clip for r, clip in zip(records, norms) if good(r.get(key)) and clip > 0]
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
        if not good(target):
            row[own] = row[common] = "naive not finished" if naive is None else "naive diverged"
            continue
        data = finished[row["run"]]
        hit = first(data["val"], "val/ppl", target, True)
        row[own] = round(modelled_at(hit, data["train"]), 3) if hit else "not reached"
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
        if good(target) and per_step is not None else "Naive parallel has no finished finite val/ppl yet: no time-to-target."
    )
    return {"val/ppl": target}, note


#: The report kinds that add columns to the one table (``converge`` builds tables of its own).
COLUMNS = {
    "speedup": _speedup_columns,
    "isweep": _isweep_columns,
    "tune-gamma": _tune_columns,
    "speedup-converge": _speedup_end_columns,
    "regime": _regime_columns,
}
