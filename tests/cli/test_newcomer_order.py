"""The order of the checks before a run starts: the run folder (its lock, a resume's config)
before the corpus, so that a refused folder is one line and costs no download."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from localclip import data
from localclip.errors import DataError
from localclip.cli import main, train_config
from localclip.train import RunFolder, run_config_json
from helpers import write_tiny_ptb

FAST = ["--no-progress", "--workers", "2", "--period", "2", "--max-steps", "2", "--set", "eval_tokens=2000"]


@pytest.fixture
def custom_root(tmp_path) -> Path:
    """A data root whose PTB is a small custom corpus: checking it prints a warning per file."""
    root = tmp_path / "data"
    write_tiny_ptb(root / data.CORPORA["ptb"].folder)
    return root


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_in_use_is_refused_in_one_line_before_the_corpus_is_checked(capsys, tmp_path, custom_root, resume):
    out = tmp_path / "run"
    flags = [*FAST, "--data-root", str(custom_root), "--allow-custom-corpus", "--out", str(out)]
    if resume:  # a started run that another process is continuing
        out.mkdir()
        (out / "config.json").write_text(run_config_json(train_config(["ptb-small", *flags])) + "\n")
    else:  # a fresh run whose folder the other process has just made
        out.mkdir()
    before = digest(out)
    holder = RunFolder(out)
    holder.claim()
    try:
        code, err = run_cli(capsys, "train", "ptb-small", *flags, *(["--resume"] if resume else []))
    finally:
        holder.release()
    assert code == 2
    assert err.splitlines() == [f"localclip: error: {out} is in use by another localclip process (a run or a sweep writing to it); "
                                "wait for it to end, or choose another --out"]
    assert digest(out) == before


def test_a_resume_with_another_dataset_names_the_difference_before_any_download(capsys, tmp_path, custom_root, monkeypatch):
    """The run trained on PTB; the resume asks for WikiText-2, which is not on disk: the config
    comparison answers, and nothing is fetched."""
    fetched = []

    def no_network(name, *args, **kwargs):
        fetched.append(name)
        raise DataError("no network in this test")

    monkeypatch.setattr(data, "download_corpus", no_network)
    out = tmp_path / "run"
    flags = [*FAST, "--data-root", str(custom_root), "--allow-custom-corpus", "--out", str(out)]
    out.mkdir()
    (out / "config.json").write_text(run_config_json(train_config(["ptb-small", *flags])) + "\n")
    before = digest(out)
    code, err = run_cli(capsys, "train", "ptb-small", *flags, "--resume", "--set", "dataset=wikitext2")
    assert code == 2 and fetched == []
    assert len(err.splitlines()) == 1 and "dataset: 'ptb' in the run, 'wikitext2' now" in err, err
    assert digest(out) == before
    assert not (custom_root / data.CORPORA["wikitext2"].folder).exists()


def test_a_missing_corpus_is_still_fetched_for_a_folder_that_is_free(capsys, tmp_path, custom_root, monkeypatch):
    """The fetch moved after the folder's checks, not away: a fresh run on a missing corpus asks for it."""
    fetched = []

    def no_network(name, *args, **kwargs):
        fetched.append(name)
        raise DataError("no network in this test")

    monkeypatch.setattr(data, "download_corpus", no_network)
    out = tmp_path / "run"
    code, err = run_cli(capsys, "train", "ptb-small", *FAST, "--data-root", str(custom_root), "--set", "dataset=wikitext2", "--out", str(out))
    assert code == 2 and fetched == ["wikitext2"]
    assert "could not be downloaded" in err and not out.exists()
