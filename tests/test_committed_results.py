"""The committed sweep tables are what `localclip report` makes of the committed runs today."""

import shutil
from pathlib import Path

import pytest

from localclip import experiments

SWEEPS = Path(__file__).resolve().parents[1] / "results" / "sweeps"
COMMITTED = sorted(p.parent for p in SWEEPS.rglob("summary.csv"))


def _tables(markdown: str) -> str:
    """summary.md without its figure links (the check runs without drawing figures)."""
    return "\n".join(line for line in markdown.splitlines() if not line.startswith("![")).rstrip()


@pytest.mark.parametrize("folder", COMMITTED, ids=[str(p.relative_to(SWEEPS)) for p in COMMITTED])
def test_report_reproduces_the_committed_tables(tmp_path, folder):
    root = tmp_path / "sweeps"
    shutil.copytree(folder, root / folder.name, ignore=shutil.ignore_patterns("*.png", "summary.csv", "summary.md"))
    experiments.report(folder.name, root, figure=False)
    assert (root / folder.name / "summary.csv").read_text() == (folder / "summary.csv").read_text(), (
        f"{folder}/summary.csv is stale: run `localclip report {folder.name} --root {folder.parent}`")
    assert _tables((root / folder.name / "summary.md").read_text()) == _tables((folder / "summary.md").read_text()), (
        f"{folder}/summary.md is stale: run `localclip report {folder.name} --root {folder.parent}`")


def test_every_committed_sweep_is_checked():
    assert len(COMMITTED) >= 10
