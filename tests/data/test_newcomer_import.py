"""The offline path: ``localclip data import CORPUS DIR`` checks files fetched elsewhere and
installs them where the command looks; the download error points at it."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from localclip import data
from localclip.cli import main
from localclip.data import corpora
from helpers import REAL_PTB, needs_real_ptb, write_tiny_ptb

SPLITS = ("train.txt", "valid.txt", "test.txt")


@pytest.fixture
def tiny_is_canonical(tmp_path, monkeypatch) -> Path:
    """A small PTB-format corpus whose checksums stand in for the canonical ones (so these tests
    run without the real corpus); returns its folder, files named train.txt, ..."""
    folder = write_tiny_ptb(tmp_path / "tiny", train_lines=200)
    shas = {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in SPLITS}
    monkeypatch.setitem(corpora.CORPORA, "ptb", dataclasses.replace(corpora.CORPORA["ptb"], sha256=shas))
    return folder


def test_files_under_their_published_names_are_verified_and_installed(capsys, tmp_path, tiny_is_canonical):
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    shutil.copy(tiny_is_canonical / "train.txt", fetched / "ptb.train.txt")
    shutil.copy(tiny_is_canonical / "valid.txt", fetched / "valid.txt")  # names may be mixed
    shutil.copy(tiny_is_canonical / "test.txt", fetched / "ptb.test.txt")
    root = tmp_path / "root"
    assert main(["data", "import", "ptb", str(fetched), "--data-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"ptb: verified in {root / 'ptbdataset'}"
    for f in SPLITS:
        assert (root / "ptbdataset" / f).read_bytes() == (tiny_is_canonical / f).read_bytes()
    assert sorted(p.name for p in (root / "ptbdataset").iterdir()) == sorted(SPLITS)  # no temporary file left
    assert data.verify_corpus("ptb", root) == []  # where train finds it, as the canonical corpus


def test_a_file_with_another_checksum_installs_nothing(capsys, tmp_path, tiny_is_canonical):
    fetched = tmp_path / "fetched"
    shutil.copytree(tiny_is_canonical, fetched)
    (fetched / "test.txt").write_text("not the test split\n")
    root = tmp_path / "root"
    assert main(["data", "import", "ptb", str(fetched), "--data-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{fetched / 'test.txt'} is not the canonical ptb test.txt" in err
    assert not root.exists()


def test_a_missing_file_is_named_with_the_names_looked_for(capsys, tmp_path, tiny_is_canonical):
    fetched = tmp_path / "fetched"
    shutil.copytree(tiny_is_canonical, fetched)
    (fetched / "valid.txt").unlink()
    root = tmp_path / "root"
    assert main(["data", "import", "ptb", str(fetched), "--data-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no ptb valid.txt (looked for valid.txt, ptb.valid.txt)" in err
    assert not root.exists()


def test_the_download_error_names_the_published_files_and_the_import_command(capsys, tmp_path, monkeypatch):
    def offline(url, *args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    root = tmp_path / "root"
    root.mkdir()
    assert main(["train", "ptb-small", "--no-progress", "--max-steps", "1", "--data-root", str(root), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        assert f"/{name}" in err
    assert f"localclip data import ptb DIR --data-root {root}" in err
    assert "Copy train.txt" not in err
    assert list(root.iterdir()) == [] and not (tmp_path / "run").exists()


@needs_real_ptb
def test_the_real_ptb_under_its_published_names(capsys, tmp_path):
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for f in SPLITS:
        shutil.copy(REAL_PTB / "ptbdataset" / f, fetched / f"ptb.{f}")
    assert main(["data", "import", "ptb", str(fetched), "--data-root", str(tmp_path / "root")]) == 0
    assert data.verify_corpus("ptb", tmp_path / "root") == []
