"""The committed sweep tables are what `localclip report` makes of the committed runs today."""

import re
import shutil
from pathlib import Path

import pytest

import localclip_lab as experiments

from helpers import REPO

RESULTS = REPO / "results"
COMMITTED = sorted(p.parent for p in RESULTS.rglob("summary.csv"))
TABLES = ("summary.csv", "mechanism.csv")


def _tables(markdown: str) -> str:
    """summary.md without its figure links (the check runs without drawing figures)."""
    text = "\n".join(line for line in markdown.splitlines() if not line.startswith("![")).rstrip()
    return re.sub(r"\n{3,}", "\n\n", text)  # the blank line that stood beside a figure link


# The fast tier regenerates the smallest committed report; the full suite every one.
SMALLEST = min(COMMITTED, key=lambda folder: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))


@pytest.mark.parametrize("folder", [pytest.param(p, marks=() if p == SMALLEST else pytest.mark.full) for p in COMMITTED],
                         ids=[str(p.relative_to(RESULTS)) for p in COMMITTED])
def test_report_reproduces_the_committed_tables(tmp_path, folder):
    root = tmp_path / "sweeps"
    shutil.copytree(folder, root / folder.name, ignore=shutil.ignore_patterns("*.png", *TABLES, "summary.md"))
    experiments.report(folder.name, root, figure=False)
    for table in TABLES:
        if (folder / table).exists():
            assert (root / folder.name / table).read_text() == (folder / table).read_text(), (
                f"{folder}/{table} is stale: run `localclip report {folder.name} --root {folder.parent}`")
    assert _tables((root / folder.name / "summary.md").read_text()) == _tables((folder / "summary.md").read_text()), (
        f"{folder}/summary.md is stale: run `localclip report {folder.name} --root {folder.parent}`")


def test_every_committed_sweep_is_checked():
    assert len(COMMITTED) >= 10
