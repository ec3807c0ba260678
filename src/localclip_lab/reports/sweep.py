"""Reporting a sweep: which of its runs finished, which report kind it gets, and which tables and
figures that writes, from its committed run files (``config.json``, ``metrics.jsonl``,
``summary.json``), finished runs only. The pieces: the run files (:mod:`.runs`), the modelled link
(:mod:`.link`), the kinds' columns (:mod:`.columns`, :mod:`.converge`), the table files
(:mod:`.tables`) and the figures (:mod:`.figures`, :mod:`.mechanism`).

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

import functools
import json
import os
from pathlib import Path

from localclip.errors import LocalclipError
from localclip.train.run_folder import atomic_write_text
from localclip_lab.plans import SweepError, plan, report_kind
from localclip_lab.reports import mechanism
from localclip_lab.reports.columns import COLUMNS
from localclip_lab.reports.converge import CONVERGE_GROUPS, converge_groups, converge_tables
from localclip_lab.reports.figures import converge_curves, speedup_curves
from localclip_lab.reports.link import BANDWIDTH, LATENCY
from localclip_lab.reports.runs import load_finished, table_row
from localclip_lab.reports.tables import markdown, write_csv

__all__ = ["report"]


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
    validation perplexity; ``converge`` reports at convergence (see :func:`~localclip_lab.reports.converge.converge_tables`)
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
                finished[run] = load_finished(folder / run)
            except (OSError, json.JSONDecodeError) as exc:
                raise SweepError(f"{folder / run}: unreadable run files ({exc})") from exc
    unfinished = [run for run in names if run not in finished]

    rows = [table_row(run, data) for run, data in finished.items()]
    targets: dict = {}
    notes: list[str] = []
    tables: list[tuple[str, list[str]]] = []
    kind = report_kind(name)
    if kind == "converge":
        targets, tables, note = converge_tables(rows, finished)
        notes.append(note)
    elif kind in COLUMNS:
        columns_of = functools.partial(COLUMNS[kind], loss_target=loss_target, ppl_target=ppl_target) if kind == "speedup" else COLUMNS[kind]
        targets, note = columns_of(rows, finished)
        notes.append(note)

    result = {
        "sweep": name, "folder": str(folder), "rows": rows, "finished": list(finished), "unfinished": unfinished,
        "targets": targets, "csv": str(folder / "summary.csv"), "markdown": str(folder / "summary.md"),
        "figure": None, "figures": {}, "figure_error": None, "figure_note": None, "curves": None,
    }
    columns = write_csv(folder / "summary.csv", rows)

    figure_path = folder / "figure.png"
    from localclip.plot import NO_MATPLOTLIB, have_matplotlib

    if figure and finished and not have_matplotlib():
        result["figure_note"] = NO_MATPLOTLIB  # the tables do not need it
    elif figure and finished:
        from localclip.plot import plot_runs

        # converge has too many runs for one readable figure: one per group, each run beside
        # the runs it is judged against.
        groups = converge_groups(finished) if kind == "converge" else {"": list(finished)}
        try:
            for group, runs in groups.items():
                path = folder / f"figure{CONVERGE_GROUPS.get(group, '')}.png"
                plot_runs([str(folder / run) for run in runs], path, labels=runs, bandwidth=BANDWIDTH, latency=LATENCY,
                          title=f"sweep {name}" + (f": {group}" if group else ""))
                result["figures"][group] = path.name
            result["figure"] = str(figure_path) if "" in groups or "main runs" in groups else None
            if kind == "converge":
                result["curves"] = str(converge_curves(finished, groups, folder / "curves.png", name))
            if kind == "speedup-converge":
                result["speedup_curves"] = str(speedup_curves(finished, folder / "speedup.png", name))
        except LocalclipError as exc:  # the tables are still worth having
            result["figure_error"] = str(exc)
    if any(mechanism.has_statistics(data) for data in finished.values()):
        try:
            result["mechanism"] = mechanism.write_mechanism(finished, folder, f"sweep {name}")
        except ImportError as exc:  # the per-epoch table is written before the figure
            result["figure_error"] = result["figure_error"] or f"mechanism.png needs matplotlib ({exc})"
    atomic_write_text(folder / "summary.md", markdown(name, rows, tables or [("", columns)], unfinished, notes, result))
    return result
