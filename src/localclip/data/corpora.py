"""Word-level language-model corpora: where they live, what they must contain, how they become ids.

This module owns the known corpora (PTB and WikiText-2) with their canonical SHA-256 checksums,
the resolution of the data root, the tokenizer (every line split on whitespace, then ``<eos>``),
the vocabulary (ids in order of first appearance over train, valid, then test) and the caches
that keep tokenizing WikiText-2 from costing seconds on every run.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import os
import tempfile
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localclip.errors import DataError

__all__ = [
    "CORPORA",
    "EOS",
    "SPLITS",
    "Corpus",
    "CorpusSpec",
    "CustomCorpusWarning",
    "Vocabulary",
    "corpus_path",
    "verify_corpus",
    "file_sha256",
    "load_corpus",
    "load_corpus_from_dir",
    "read_tokens",
    "resolve_data_root",
    "split_lines",
    "tokenize_lines",
]

EOS = "<eos>"
SPLITS = ("train", "valid", "test")
DATA_ENV_VAR = "LOCALCLIP_DATA"


@dataclass(frozen=True)
class CorpusSpec:
    """What a known corpus must look like on disk."""

    name: str
    """Name used by the API and the CLI (``localclip data download NAME``)."""
    folder: str
    """Folder under the data root that holds ``train.txt``, ``valid.txt`` and ``test.txt``."""
    sha256: dict[str, str]
    """Canonical SHA-256 of each split file, keyed by file name."""
    num_tokens: dict[str, int]
    """Tokens (words plus one ``<eos>`` per line) of each split, keyed by split name."""
    vocab_size: int
    """Size of the vocabulary built over all three splits."""


# Checksums of the exact files the paper's experiments read (shared/data/SHA256SUMS); the token
# counts come from the same folder's README and are asserted by the tests.
CORPORA: dict[str, CorpusSpec] = {
    "ptb": CorpusSpec(
        name="ptb",
        folder="ptbdataset",
        sha256={
            "train.txt": "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
            "valid.txt": "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
            "test.txt": "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
        },
        num_tokens={"train": 929_589, "valid": 73_760, "test": 82_430},
        vocab_size=10_000,
    ),
    "wikitext2": CorpusSpec(
        name="wikitext2",
        folder="wikitext2",
        sha256={
            "train.txt": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
            "valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
            "test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
        },
        num_tokens={"train": 2_088_628, "valid": 217_646, "test": 245_569},
        vocab_size=33_278,
    ),
}


# ---------------------------------------------------------------------------------------------
# Where the data lives
# ---------------------------------------------------------------------------------------------


def resolve_data_root(data_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds the corpus folders.

    In order: ``data_root`` when given, else the environment variable ``LOCALCLIP_DATA``, else
    ``$XDG_CACHE_HOME/localclip/data`` (``~/.cache/localclip/data`` when that is unset). The
    folder need not exist; :func:`load_corpus` reports what is missing.
    """
    if data_root is not None and str(data_root) != "":
        return Path(data_root).expanduser()
    env = os.environ.get(DATA_ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    cache = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return cache / "localclip" / "data"


def _spec(name: str) -> CorpusSpec:
    try:
        return CORPORA[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(CORPORA))
        raise DataError(
            f"Unknown corpus {name!r}; known corpora: {known}. "
            "For your own text use load_corpus_from_dir(PATH) or --allow-custom-corpus."
        ) from None


def corpus_path(name: str, data_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds corpus ``name``: ``<root>/<folder>`` (e.g. ``<root>/ptbdataset``).

    A root that is itself a corpus folder, holding ``train.txt``, ``valid.txt`` and ``test.txt``
    (``--data-root .../ptbdataset``, or any folder of a custom corpus not named like another
    known corpus), is accepted too, so both a shared folder of corpora and a single corpus copy
    work; its files are checked against the canonical checksums like any others. The path need
    not exist.
    """
    spec = _spec(name)
    root = resolve_data_root(data_root)
    nested = root / spec.folder
    if nested.is_dir():
        return nested
    others = {n for other in CORPORA.values() if other.name != spec.name for n in (other.folder, other.name)}
    if root.name not in others and all((root / f"{split}.txt").is_file() for split in SPLITS):
        return root  # a folder named like another known corpus is not taken for this one
    return nested


# ---------------------------------------------------------------------------------------------
# Text to tokens (pure functions: any str in, never an exception out)
# ---------------------------------------------------------------------------------------------


def split_lines(text: str) -> list[str]:
    """Lines of ``text`` exactly as iterating a file opened in text mode yields them.

    ``str.splitlines`` would also break at ``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``,
    U+2028 and U+2029, adding ``<eos>`` tokens the reference code (``for line in open(path)``)
    never produced; here only ``\\n``, ``\\r\\n`` and ``\\r`` end a line. A final line without
    a terminator is still a line.
    """
    if not isinstance(text, str):
        raise TypeError(f"split_lines expects str, got {type(text).__name__}")
    return list(io.StringIO(text, newline=None))


def tokenize_lines(lines: Iterable[str]) -> list[str]:
    """Every line split on whitespace, each followed by ``<eos>`` (empty lines too).

    Each element of ``lines`` is one line; a line terminator inside an element is just
    whitespace. This is the tokenization of the AWD-LSTM reference and of the published token
    counts (PTB train: 929,589), and it accepts any string.
    """
    if isinstance(lines, (str, bytes)):
        # Iterating a str yields characters; that would "work" and silently give garbage.
        raise TypeError("tokenize_lines expects an iterable of lines, not a single string")
    tokens: list[str] = []
    for line in lines:
        tokens.extend(line.split())
        tokens.append(EOS)
    return tokens


def _decode(data: bytes, path: Path) -> str:
    try:
        # utf-8-sig: a byte-order mark (common in text saved on Windows) is not part of a word.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not valid UTF-8 (byte {e.start}: {e.reason}). "
            f"Convert it, e.g. `iconv -f latin1 -t utf-8 {path} > {path}.utf8`."
        ) from None


def read_tokens(path: str | os.PathLike[str]) -> list[str]:
    """The token stream of one text file (UTF-8)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"Missing file {path}.") from None
    except OSError as e:
        raise DataError(f"Cannot read {path}: {e.strerror or e}.") from None
    return tokenize_lines(split_lines(_decode(data, path)))


# ---------------------------------------------------------------------------------------------
# Vocabulary and corpus
# ---------------------------------------------------------------------------------------------


@dataclass
class Vocabulary:
    """Word <-> id maps; ids are assigned in order of first appearance."""

    word2idx: dict[str, int] = field(default_factory=dict)
    idx2word: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.idx2word)

    def __repr__(self) -> str:
        # The default repr prints 33,278 words into every traceback and log line.
        head = ", ".join(map(repr, self.idx2word[:5]))
        return f"Vocabulary(size={len(self)}, first=[{head}{', ...' if len(self) > 5 else ''}])"

    def __contains__(self, word: object) -> bool:
        return word in self.word2idx

    def add_word(self, word: str) -> int:
        idx = self.word2idx.get(word)
        if idx is None:
            idx = self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return idx

    def encode(self, tokens: Iterable[str], *, add: bool = False) -> torch.Tensor:
        """Ids of ``tokens`` as a 1-D long tensor (``add`` extends the vocabulary as it goes)."""
        if add:
            ids = [self.add_word(t) for t in tokens]
        else:
            w2i = self.word2idx
            try:
                ids = [w2i[t] for t in tokens]
            except KeyError as e:
                raise KeyError(f"token {e.args[0]!r} is not in the vocabulary") from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> list[str]:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return [self.idx2word[i] for i in ids]

    @classmethod
    def from_words(cls, words: Iterable[str]) -> Vocabulary:
        vocab = cls()
        for w in words:
            vocab.add_word(w)
        return vocab


@dataclass(eq=False)  # tensors have no truth value: == is identity, compare fields explicitly
class Corpus:
    """A tokenized corpus: one vocabulary and one 1-D ``torch.long`` id stream per split."""

    name: str
    vocab: Vocabulary
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    path: Path | None = None
    """The folder the text was read from."""
    sha256: dict[str, str] = field(default_factory=dict)
    """SHA-256 of each split file as read (for run manifests: which data a run saw)."""

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={getattr(self, s).numel()}" for s in SPLITS)
        return f"Corpus(name={self.name!r}, vocab={len(self.vocab)}, {sizes}, path={str(self.path)!r})"

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise ValueError(f"Invalid split {name!r}; expected one of {SPLITS}")
        return getattr(self, name)


# ---------------------------------------------------------------------------------------------
# Checksums and caches
# ---------------------------------------------------------------------------------------------


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int, inode: int) -> str:
    # Keyed on the file's stat, so a rewritten file is hashed again and an unchanged one is not.
    return _sha256_of(Path(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file (hex), memoized per (path, size, mtime, inode) within the process."""
    p = Path(path).resolve()
    st = p.stat()
    return _sha256_cached(str(p), st.st_size, st.st_mtime_ns, st.st_ino)


_DISK_CACHE_NAME = ".localclip-tokens-v1.pt"
_DISK_CACHE_VERSION = 1

# Tokenized corpora keyed by the content (the three checksums), so two folders holding the same
# files share one entry and an edited file never hits a stale one. Small: each entry of
# WikiText-2 is ~20 MB.
_MEMORY_CACHE: collections.OrderedDict[tuple[str, ...], tuple[list[str], list[torch.Tensor]]]
_MEMORY_CACHE = collections.OrderedDict()
_MEMORY_CACHE_SIZE = 4
_MEMORY_LOCK = threading.Lock()


def _read_disk_cache(folder: Path, key: tuple[str, ...]) -> tuple[list[str], list[torch.Tensor]] | None:
    path = folder / _DISK_CACHE_NAME
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("version") != _DISK_CACHE_VERSION or tuple(blob["sha256"]) != key:
            return None
        words, splits = list(blob["idx2word"]), [blob[s] for s in SPLITS]
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 1 for t in splits):
            return None
        return words, splits
    except Exception:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
        return None


def _writable(folder: Path) -> bool:
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    # A folder with no write bit is read-only on purpose (a shared copy of the data); root would
    # pass os.access and write into it anyway, so the mode bits are checked as well.
    return bool(mode & 0o222) and os.access(folder, os.W_OK)


def _write_disk_cache(folder: Path, key: tuple[str, ...], words: list[str], splits: list[torch.Tensor]) -> None:
    if not _writable(folder):
        return
    blob = {"version": _DISK_CACHE_VERSION, "sha256": list(key), "idx2word": words}
    blob.update(zip(SPLITS, splits))
    tmp = None
    try:
        # A unique temp name then os.replace: N workers tokenizing at once each publish a whole
        # file, and a reader never sees a half-written one.
        fd, tmp = tempfile.mkstemp(prefix=_DISK_CACHE_NAME + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of the folder
        os.replace(tmp, folder / _DISK_CACHE_NAME)
        tmp = None
    except OSError:
        # Read-only data folders (a shared CI copy, a system path) just go without the cache.
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _tokenize_folder(files: list[Path]) -> tuple[list[str], list[torch.Tensor]]:
    vocab = Vocabulary()
    splits = [vocab.encode(read_tokens(f), add=True) for f in files]
    return vocab.idx2word, splits


def _load_tokens(folder: Path, files: list[Path], key: tuple[str, ...], disk_cache: bool):
    with _MEMORY_LOCK:
        hit = _MEMORY_CACHE.get(key)
        if hit is not None:
            _MEMORY_CACHE.move_to_end(key)
            return hit
    hit = _read_disk_cache(folder, key) if disk_cache else None
    if hit is None:
        hit = _tokenize_folder(files)
        if disk_cache:
            _write_disk_cache(folder, key, *hit)
    with _MEMORY_LOCK:
        _MEMORY_CACHE[key] = hit
        while len(_MEMORY_CACHE) > _MEMORY_CACHE_SIZE:
            _MEMORY_CACHE.popitem(last=False)
    return hit


def _build_corpus(name: str, folder: Path, files: list[Path], shas: dict[str, str], disk_cache: bool) -> Corpus:
    key = tuple(shas[f.name] for f in files)
    words, splits = _load_tokens(folder, files, key, disk_cache)
    # Fresh objects per call: the cache must not be changed through a caller's corpus.
    words = list(words)
    vocab = Vocabulary({w: i for i, w in enumerate(words)}, words)
    train, valid, test = (t.clone() for t in splits)
    return Corpus(name, vocab, train, valid, test, path=folder, sha256=dict(shas))


def _split_files(folder: Path) -> list[Path]:
    return [folder / f"{s}.txt" for s in SPLITS]


# ---------------------------------------------------------------------------------------------
# Public loaders
# ---------------------------------------------------------------------------------------------


def load_corpus(
    name: str,
    data_root: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    allow_custom: bool = False,
    disk_cache: bool = True,
    warn: bool = True,
) -> Corpus:
    """Load a known corpus (``"ptb"`` or ``"wikitext2"``) from the data root.

    Args:
        name: a key of :data:`CORPORA`.
        data_root: folder holding the corpus folders; see :func:`resolve_data_root`.
        verify: check each file's SHA-256 against the canonical one, so results stay comparable
            with the paper's.
        allow_custom: accept files whose checksum differs (a modified or custom corpus) with a
            warning instead of an error; the CLI flag is ``--allow-custom-corpus``.
        warn: with ``allow_custom``, warn (:class:`CustomCorpusWarning`) about each accepted
            file; a launcher that has said so once already passes False to its workers.
        disk_cache: keep the tokenized corpus in ``<corpus folder>/.localclip-tokens-v1.pt``
            (skipped silently when the folder is read-only).
    """
    spec = _spec(name)
    folder = corpus_path(name, data_root)
    files = _split_files(folder)
    notes = verify_corpus(name, data_root, allow_custom=allow_custom) if verify else _check_present(name, data_root)
    if warn:
        for note in notes:
            warnings.warn(CustomCorpusWarning(note), stacklevel=2)
    shas = {f.name: file_sha256(f) for f in files}
    return _build_corpus(spec.name, folder, files, shas, disk_cache)


def _check_present(name: str, data_root) -> list[str]:
    spec = _spec(name)
    root = resolve_data_root(data_root)
    folder = corpus_path(name, root)
    files = _split_files(folder)
    for f in files:
        if not f.is_file():
            raise DataError(
                f"Missing {spec.name} file {f}. Download the corpus with "
                f"`localclip data download {spec.name} --data-root {root}` "
                f"(or copy {', '.join(p.name for p in files)} into {folder})."
            )
    return []


def verify_corpus(name: str, data_root: str | os.PathLike[str] | None = None, *, allow_custom: bool = False) -> list[str]:
    """Check that corpus ``name`` is complete and canonical (SHA-256), without loading it.

    Raises :class:`DataError` naming the missing or differing file and the fix; with
    ``allow_custom`` a differing file is accepted and described in the returned list, one line
    per file (empty for the canonical corpus).
    """
    spec = _spec(name)
    root = resolve_data_root(data_root)
    _check_present(name, root)
    notes = []
    for f in _split_files(corpus_path(name, root)):
        expected, actual = spec.sha256[f.name], file_sha256(f)
        if actual == expected:
            continue
        if not allow_custom:
            raise DataError(
                f"Checksum mismatch for {f}: expected sha256 {expected}, got {actual}. "
                f"The file is not the canonical {spec.name} {f.name}; re-download it with "
                f"`localclip data download {spec.name} --data-root {root}`, or, to train on "
                "a custom corpus on purpose, pass allow_custom=True (CLI: --allow-custom-corpus)."
            )
        notes.append(f"{f} differs from the canonical {spec.name} {f.name} (sha256 {actual}); results are not comparable with the paper's")
    return notes


class CustomCorpusWarning(UserWarning):
    """A corpus file differs from the canonical one and ``allow_custom`` accepted it."""


def load_corpus_from_dir(
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    disk_cache: bool = True,
) -> Corpus:
    """Load any folder holding ``train.txt``, ``valid.txt`` and ``test.txt`` (no checksum check).

    The vocabulary covers the three splits in that order, as for the known corpora.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(f"Corpus folder {folder} does not exist; it must hold train.txt, valid.txt and test.txt.")
    files = _split_files(folder)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(f"Missing corpus file(s): {', '.join(missing)}; a corpus folder holds train.txt, valid.txt and test.txt.")
    shas = {f.name: file_sha256(f) for f in files}
    return _build_corpus(name or folder.name, folder, files, shas, disk_cache)
