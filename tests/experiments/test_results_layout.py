"""results/ is laid out by question: each run committed once, no scripts or logs, every folder the
docs cite is there, and the sweep plans make the committed runs."""

import hashlib
import os
import re
from pathlib import Path

import localclip_lab as experiments
from localclip.train.run_folder import RunFolder
from localclip.algorithms import build

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"


def _walk():
    """(run folders, links to run folders) under results/, without following the links."""
    runs, links = [], []
    for folder, dirs, files in os.walk(RESULTS):
        here = Path(folder)
        links += [here / d for d in dirs if (here / d).is_symlink()]
        if "config.json" in files:
            runs.append(here)
    return sorted(runs), sorted(links)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def test_no_run_folder_is_a_copy_of_another():
    runs, _ = _walk()
    seen: dict[str, Path] = {}
    copies = []
    for run in runs:
        digest = _digest(run)
        if digest in seen:
            copies.append(f"{run.relative_to(RESULTS)} = {seen[digest].relative_to(RESULTS)}")
        seen.setdefault(digest, run)
    assert len(runs) > 100 and not copies, copies


def test_a_linked_run_is_a_finished_run_of_the_same_configuration():
    _, links = _walk()
    assert links
    for link in links:
        target = link.resolve()
        assert target.is_relative_to(RESULTS.resolve()) and not Path(os.readlink(link)).is_absolute(), link
        assert RunFolder(target).finished, f"{link} -> {target}: not a finished run"
        mine = dict(experiments.plan(link.parent.name))[link.name]
        theirs = dict(experiments.plan(target.parent.name))[target.name]
        assert mine.to_dict() == theirs.to_dict(), f"{link} -> {target}: another configuration"


def test_results_hold_runs_and_tables_not_scripts_logs_or_reruns():
    odd = [p.relative_to(RESULTS) for p in RESULTS.rglob("*")
           if (p.is_file() and p.suffix in {".py", ".sh", ".log"}) or (p.is_dir() and p.name.endswith("-rerun"))]
    assert not odd, odd


def _cited(text: str) -> set[str]:
    # results/ at the repository's top, not benchmarks/results/ (the benchmarks' records)
    paths = {m.rstrip(".,") for m in re.findall(r"(?<![\w/])results/[\w./{}-]+", text)}
    # a placeholder (NAME, {a,b}) and the CLI's default root for new sweeps are not committed folders
    return {p for p in paths if not re.search(r"[A-Z{]", p) and p != "results/sweeps"}


def test_every_results_path_the_docs_and_code_cite_exists():
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "src").rglob("*.py")),
               *sorted((REPO / "benchmarks").glob("*.py"))]
    missing = sorted(f"{src.relative_to(REPO)}: {p}" for src in sources for p in _cited(src.read_text(encoding="utf-8"))
                     if not (REPO / p).exists())
    assert not missing, missing


def test_results_readme_maps_every_sweep_folder_and_names_only_folders_that_exist():
    readme = (RESULTS / "README.md").read_text(encoding="utf-8")
    mapping = readme.split("## The records")[0]
    rows = [line.split("|")[2] for line in mapping.splitlines() if line.startswith("| ") and line.count("|") > 3]
    named = {p for row in rows for p in re.findall(r"`([\w./-]+/)`", row)}
    assert named and not sorted(p for p in named if not (RESULTS / p).is_dir())
    sweeps = {str(p.parent.relative_to(RESULTS)) + "/" for p in RESULTS.rglob("summary.md")}
    assert sweeps and not sorted(sweeps - named)


def test_the_gpt_sweep_makes_the_committed_transformer_runs():
    plan = dict(experiments.plan("gpt"))
    folder = RESULTS / "transformer" / "gpt"
    assert sorted(plan) == sorted(p.name for p in folder.iterdir() if p.is_dir())
    for name, cfg in plan.items():
        committed, provenance = RunFolder(folder / name).read_config()
        assert provenance and provenance["commit"]
        differ = {k for k, v in committed.to_flat().items() if k != "data_root" and v != build.resolved(cfg).to_flat()[k]}
        assert not differ, (name, differ)
