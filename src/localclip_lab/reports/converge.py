"""The ``converge`` report: runs judged at the end of their schedule against their naive
baseline and their plain CELGC counterpart, the modelled time to the baseline's perplexity on
two links, and the seed-to-seed spread of runs that differ only in their seed.
"""

from __future__ import annotations

import json
import statistics

from localclip.train.run_folder import RESUME_MAY_CHANGE
from localclip_lab.reports.link import AWD_MESSAGE_BYTES, LATENCY, LINKS, WIRE_FRACTION, seconds_to
from localclip_lab.reports.runs import best_validation, epoch_ends, first, good, validations
from localclip_lab.reports.tables import cell

__all__ = ["CONVERGE_GROUPS", "QUALITY_LEVELS", "baseline", "converge_groups", "converge_tables"]

# converge: the quality levels a user may settle for, as the naive baseline's final val/ppl
# times these factors (within 20 %, 10 %, 5 % of it, and it).
QUALITY_LEVELS = (1.2, 1.1, 1.05, 1.0)
# converge: the three comparisons a run can belong to, each with its own figure (file suffix).
CONVERGE_GROUPS = {"main runs": "", "scenarios": "-scenarios", "beyond the paper": "-beyond"}


def _schedule_kind(config: dict) -> tuple:
    """What kind of schedule a run trains with: step-decayed or constant, with or without the
    end-of-epoch weight average (a longer run's decay starts later, yet is the same kind)."""
    return bool(config.get("lr_decay_epochs")), config.get("asgd_patience") or 0

def baseline(run: str, data: dict, finished: dict) -> str | None:
    """The naive parallel run this run is judged against: same length, seed, data split, schedule,
    momentum and model (its options: dropout). A run longer than every such naive run (CELGC given
    more epochs, to compare at equal time) is judged against the longest shorter one. A naive run
    is judged across model options, against the sweep's first such naive: what a model option
    does to naive is a tuning question (``converge-tune``), and against itself it would read 0."""
    # Trained the same way: the schedule (step decay, the end-of-epoch weight average) and, for
    # every algorithm but naive itself, the model's regularisation are part of it.
    key = ("seed", "heterogeneous", "momentum") + (() if data["config"].get("algorithm") == "naive" else ("model_options",))
    naive = {other: d["config"] for other, d in finished.items()
             if d["config"].get("algorithm") == "naive" and all(d["config"].get(k) == data["config"].get(k) for k in key)
             and _schedule_kind(d["config"]) == _schedule_kind(data["config"])}
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
    participation, momentum, lr, γ, schedule and model, with plain averaging and blocking whole-model
    float32 rounds."""
    if _group(data["config"]) != "beyond the paper":
        return None
    key = ("period", "epochs", "seed", "heterogeneous", "participants", "momentum", "lr", "gamma", "lr_decay_epochs", "lr_decay", "asgd_patience", "model_options")
    matches = [other for other, d in finished.items()
               if d["config"].get("algorithm") == "celgc" and _group(d["config"]) != "beyond the paper"
               and all(d["config"].get(k) == data["config"].get(k) for k in key)]
    return matches[0] if matches else None


def converge_groups(finished: dict) -> dict[str, list[str]]:
    """The runs of each group that has any, in sweep order; a scenario or beyond-the-paper run
    brings its naive baseline and its plain counterpart along, to be compared in the figure."""
    groups: dict[str, list[str]] = {}
    for run, data in finished.items():
        group = _group(data["config"])
        members = groups.setdefault(group, [])
        along = () if group == "main runs" else (baseline(run, data, finished), _plain(run, data, finished))
        for member in (*along, run):  # a naive run is its own baseline: add it once
            if member and member not in members:
                members.append(member)
    return {group: groups[group] for group in CONVERGE_GROUPS if group in groups}


def converge_tables(rows: list[dict], finished: dict) -> tuple[dict, list, str]:
    """Per run: final perplexities and their noise (spread over the last three validations),
    rounds and rounds per epoch, bytes, the gain of the last two epochs; and the modelled time
    to reach the final perplexity of its naive baseline (:func:`baseline`) on a 1 and a
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
        vals = [r["val/ppl"] for r in validations(data)]
        last = vals[-3:]
        row["seed"] = c.get("seed")
        row["dropout"] = (c.get("model_options") or {}).get("dropout")
        row["spread last 3 val"] = (max(last) - min(last)) if len(last) == 3 and all(good(v) for v in last) else None
        epochs = row["epochs"] or 0
        row["rounds/epoch"] = row["comm/rounds"] / epochs if row["comm/rounds"] is not None and epochs else None
        row["MB sent"] = row["comm/bytes"] / 1e6 if row["comm/bytes"] is not None else None
        ends = epoch_ends(data)
        if ends and max(ends) - 2 in ends and good(ends[max(ends)]) and good(ends[max(ends) - 2]):
            e = max(ends)
            row["gain last 2 epochs %"] = 100 * (ends[e - 2] - ends[e]) / ends[e - 2]
        else:
            row["gain last 2 epochs %"] = None
        base = baseline(row["run"], data, finished)
        row["group"] = _group(c)
        row["baseline"] = base
        target = finished[base]["summary"].get("val/ppl") if base else None
        row["vs naive %"] = _percent(row.get("val/ppl"), target)
        best = best_validation(data)
        row["best val/ppl"] = best["val/ppl"] if best else None
        row["best at epoch"] = best.get("epoch") if best else None
        base_best = best_validation(finished[base]) if base else None
        row["best vs naive best %"] = _percent(row["best val/ppl"], base_best["val/ppl"] if base_best else None)
        plain = _plain(row["run"], data, finished)
        row["plain CELGC"] = plain
        row["vs plain %"] = _percent(row.get("val/ppl"), finished[plain]["summary"].get("val/ppl") if plain else None)
        # A round of P fragments carries 1/P of the model (fragments are equal element ranges).
        message = AWD_MESSAGE_BYTES * WIRE_FRACTION.get(c.get("compression", "none"), 1.0) / (c.get("fragments") or 1)
        overlap = c.get("overlap") or 0
        row["target val/ppl"] = target
        hit = first(data["val"], "val/ppl", target, True) if good(target) else None
        row["steps to target"] = hit["step"] if hit else None
        row["rounds to target"] = hit.get("comm/rounds") if hit else None
        for link, bandwidth in LINKS.items():
            for wire, label in ((None, ""), (message, ", 97 MB")):
                col = f"s to target {link}{label}"
                row[col] = seconds_to(hit, per_step, bandwidth, wire, overlap)
                if row[col] is not None:
                    times[(row["run"], col)] = row[col]
        # The converse question: how long the baseline takes to reach what this run reaches.
        own = data["summary"].get("val/ppl")
        own_hit = first(data["val"], "val/ppl", own, True) if good(own) else None
        base_hit = first(finished[base]["val"], "val/ppl", own, True) if base and good(own) else None
        row["own final val/ppl"] = own
        row["naive steps to it"] = base_hit["step"] if base_hit else None
        row["steps to it"] = own_hit["step"] if own_hit else None
        for link, bandwidth in LINKS.items():
            mine = seconds_to(own_hit, per_step, bandwidth, message, overlap)
            theirs = seconds_to(base_hit, per_step, bandwidth, AWD_MESSAGE_BYTES)
            row[f"naive s to it {link}, 97 MB"] = theirs
            row[f"s to it {link}, 97 MB"] = mine
            row[f"naive/this to it {link}, 97 MB"] = theirs / mine if theirs and mine else None
        for factor in QUALITY_LEVELS:
            level = target * factor if good(target) else None
            level_hit = first(data["val"], "val/ppl", level, True) if level is not None else None
            for link, bandwidth in LINKS.items():
                row[f"s to naive{_level(factor)} {link}"] = seconds_to(level_hit, per_step, bandwidth, message, overlap)
                row[f"s to naive{_level(factor)} {link}, own size"] = seconds_to(level_hit, per_step, bandwidth, None, overlap)
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
        if len(members) < 2 or not all(good(v) for v in finals):
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
        gaps = ", ".join(cell(g) for g in f["vs naive %"]) if f["vs naive %"] else ""
        lines.append(f"| {', '.join(f['runs'])} | {', '.join(str(s) for s in f['seeds'])} | "
                     f"{', '.join(cell(v) for v in f['val/ppl'])} | {cell(f['mean val/ppl'])} | {cell(f['range % of mean'])} | {gaps} |")
    return "\n".join(lines) + "\n"  # a blank line ends the table


def _percent(value, reference) -> float | None:
    """How far ``value`` is above ``reference``, in % of it."""
    return 100 * (value - reference) / reference if good(value) and good(reference) and reference else None


def _level(factor: float) -> str:
    return f"+{100 * (factor - 1):.0f} %"
