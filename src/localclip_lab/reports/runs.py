"""A finished run as a sweep's report reads it: its committed files (``config.json``,
``metrics.jsonl``, ``summary.json``), its training and validation records, and its row of the
report's one table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from localclip import jsonio
from localclip.algorithms.build import ALGORITHMS
from localclip.train.config import flat_view
from localclip_lab.reports.link import modelled_at

__all__ = ["best_validation", "config_period", "epoch_ends", "first", "good", "load_finished", "reaches", "read_records",
           "table_row", "validations"]


def read_records(folder: Path) -> list[dict]:
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


def good(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def reaches(value, target, lower: bool) -> bool:
    return good(value) and (value <= target if lower else value >= target)


def first(records: list[dict], key: str, target: float, lower: bool) -> dict | None:
    """The first record whose ``key`` is at or past ``target`` (records are in step order)."""
    return next((r for r in records if reaches(r.get(key), target, lower)), None)


def load_finished(folder: Path) -> dict:
    summary = jsonio.loads((folder / "summary.json").read_text())
    config = flat_view(jsonio.loads((folder / "config.json").read_text()))  # flat or in sections
    records = read_records(folder)
    train = [r for r in records if "train/loss" in r]
    return {"summary": summary, "config": config, "train": train, "val": [r for r in records if any(k.startswith("val/") for k in r)]}


def config_period(config: dict) -> int | None:
    """The communication period a run's config.json describes (None: one worker, no rounds)."""
    spec = ALGORITHMS.get(config.get("algorithm"))
    if spec is None:
        return None
    return spec.period(config.get("workers", 1), config.get("period"))


def table_row(run: str, data: dict) -> dict:
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
        "I": config_period(c),
        "epochs": s.get("epochs"),
        "steps": s.get("steps"),
        **diverged,
        f"val/{metric}": s.get(f"val/{metric}"),
        f"test/{metric}": s.get(f"test/{metric}"),
        "comm/rounds": s.get("comm/rounds"),
        "comm/bytes": s.get("comm/bytes"),
        "modelled s": modelled_at(data["train"][-1], data["train"]) if data["train"] else None,
    }


def validations(data: dict) -> list[dict]:
    """Validation records in step order, the final one (a repeat of the last) left out."""
    return [r for r in data["val"] if "val/ppl" in r and not r.get("final")]


def best_validation(data: dict) -> dict | None:
    """The validation record with the lowest finite perplexity, the final one included (the
    earliest of equals), or None."""
    records = [r for r in data["val"] if "val/ppl" in r and good(r["val/ppl"])]
    return min(records, key=lambda r: r["val/ppl"]) if records else None


def epoch_ends(data: dict) -> dict[int, float]:
    """Validation perplexity at the end of each whole epoch (the record whose epoch is k.0)."""
    ends = {}
    for r in validations(data):
        epoch = r.get("epoch")
        if isinstance(epoch, (int, float)) and round(epoch) >= 1 and abs(epoch - round(epoch)) < 1e-6:
            ends[round(epoch)] = r["val/ppl"]
    return ends
