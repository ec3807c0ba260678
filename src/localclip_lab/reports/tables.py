"""A sweep's tables as files: ``summary.csv`` (one row per finished run, every column of every
table) and ``summary.md`` (the tables, the notes on how their columns are computed, the figures).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from localclip.train.run_folder import atomic_write_text
from localclip_lab.plans import SWEEPS
from localclip_lab.reports.link import BANDWIDTH, LATENCY

__all__ = ["cell", "markdown", "write_csv"]


def write_csv(path: Path, rows: list[dict]) -> list[str]:
    """Write ``rows`` to ``path`` as CSV, every column any row has, in order of appearance; return
    the columns."""
    columns = list(dict.fromkeys(k for row in rows for k in row)) or ["run"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    atomic_write_text(path, buffer.getvalue())
    return columns


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def markdown(name: str, rows: list[dict], tables: list[tuple[str, list[str]]], unfinished: list[str], notes: list[str], result: dict) -> str:
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
            lines.append("| " + " | ".join(cell(row.get(k)) for k in columns) + " |")
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
