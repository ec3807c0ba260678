"""Whether today's code still produces a committed run: its steps up to its first round, rerun.

A table's numbers are only as good as the code that can make them again. :func:`check_sweep`
reruns every finished run of a sweep folder from its own ``config.json``, in a temporary folder,
for the steps of its first ``metrics.jsonl`` training record that comes after a round (the first
record of all for a run that never communicates), and compares that record's training loss with
the committed one. The first record alone would not do: at a period longer than the logging
interval it is made before any round, so a change to what a round computes would pass unseen.
Runs whose config pins one intra-op thread per worker (every sweep's) are deterministic, so a
relative difference above :data:`TOLERANCE` means the code now computes something else than
when the run was made, or that another CPU computed it: MKL and ATen pick their kernels by
instruction set (:mod:`localclip.provenance`), so each line names the CPU that made the run where
it was recorded, and the one rerunning it when it is another. ``localclip report NAME --check``
prints one line per run and fails if any run differs.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from localclip.errors import LocalclipError

__all__ = ["TOLERANCE", "check_run", "check_sweep"]

#: The largest relative difference of the checked interval's training loss that counts as the same.
TOLERANCE = 1e-6


def _train_records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    records = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "train/loss" in record:
            records.append(record)
    return records


def _checked_record(records: list[dict]) -> dict | None:
    """The first training record whose interval saw a round (``comm/rounds`` at least 1), or the
    first record where no record did (one worker, or a run stopped before its first round)."""
    return next((r for r in records if (r.get("comm/rounds") or 0) >= 1), records[0] if records else None)


def check_run(folder: Path, data_root: str | None = None) -> dict:
    """Rerun ``folder`` up to its checked record (:func:`_checked_record`); return ``{"run",
    "steps", "committed", "now", "relative", "same", "commit", "cpu", "other_cpu"}`` (``commit``
    and ``cpu``: the code version and the CPU kernels that made the run, if recorded;
    ``other_cpu``: this machine's, if the run records none or another)."""
    from localclip.provenance import code_version
    from localclip.train import RunFolder, run_training

    config, provenance = RunFolder(folder).read_config()
    provenance = provenance or {}
    first = _checked_record(_train_records(folder))
    if first is None:
        raise LocalclipError(f"{folder}: no training record in metrics.jsonl to check against")
    # Only the budget, the evaluation's length and where the data lies change: none of them moves
    # a training number up to the checked step.
    config = config.replace(
        max_steps=int(first["step"]), eval_tokens=2000, loggers=[], data_root=data_root or config.workload.data_root,
        stop_on_divergence=False,
    )
    with tempfile.TemporaryDirectory(prefix="localclip-check-") as tmp:
        run_training(config, Path(tmp) / "run", progress=False)
        now = next((r for r in _train_records(Path(tmp) / "run") if r["step"] == first["step"]), None)
    committed, again = first["train/loss"], now["train/loss"] if now else math.nan
    relative = abs(again - committed) / abs(committed) if committed else abs(again)
    cpu, here = _cpu(provenance), _cpu(code_version())
    return {
        "run": folder.name, "steps": int(first["step"]), "committed": committed, "now": again, "relative": relative,
        "same": relative <= TOLERANCE, "commit": provenance.get("commit"), "cpu": cpu, "other_cpu": here if cpu != here else None,
    }


def _cpu(provenance: dict) -> str | None:
    """The CPU and kernel choice a provenance record names (None: not recorded)."""
    if not provenance.get("cpu_capability"):
        return None
    cbwr = f", MKL_CBWR={provenance['mkl_cbwr']}" if provenance.get("mkl_cbwr") else ""
    return f"{provenance.get('cpu') or 'unknown CPU'}, {provenance['cpu_capability']}{cbwr}"


def check_sweep(folder: Path, only: list[str] | None = None, data_root: str | None = None, echo=print) -> list[dict]:
    """:func:`check_run` on every finished run of the sweep folder ``folder`` (or those ``only`` names)."""
    runs = sorted(p for p in folder.iterdir() if (p / "summary.json").is_file()) if folder.is_dir() else []
    if only:
        unknown = sorted(set(only) - {p.name for p in runs})
        if unknown:
            raise LocalclipError(f"{folder}: no finished run named {', '.join(unknown)}")
        runs = [p for p in runs if p.name in only]
    if not runs:
        raise LocalclipError(f"{folder}: no finished runs to check")
    results = []
    for path in runs:
        result = check_run(path, data_root)
        made = f" (made by {result['commit'][:10]})" if result["commit"] else " (code version not recorded)"
        if result["other_cpu"]:
            made += f" [made on {result['cpu'] or 'a CPU not recorded'}; rerun on {result['other_cpu']}]"
        verdict = "same" if result["same"] else "DIFFERS"
        echo(f"{result['run']:28s} steps 1-{result['steps']}: train/loss {result['committed']:.10g} committed, "
             f"{result['now']:.10g} now, relative {result['relative']:.1e}: {verdict}{made}")
        results.append(result)
    return results
