"""Where the tests find data, and the small corpus they make when the real one is absent.

The real corpora are looked for where the ``localclip`` command looks
(:func:`localclip.data.resolve_data_root`: ``$LOCALCLIP_DATA``, else the user cache
``~/.cache/localclip/data``); conftest.py points ``LOCALCLIP_DATA`` at a ``shared/data`` folder
beside the checkout when there is one and the variable is unset.

Tests that need a corpus only to exercise code (training, parity, resume, interrupts, bad input,
sweeps) use :data:`SHARED`: the real root when PTB is there, else a folder holding a small
PTB-format corpus written once per test session (a custom corpus: such runs pass
``--allow-custom-corpus``, which :data:`CUSTOM` and :data:`SMOKE_DATA` carry). Only tests that
check the real corpus itself, or a number computed on it, skip without it (:data:`needs_real_ptb`).
"""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from localclip.data.corpora import CORPORA, resolve_data_root

GET_PTB = "`localclip data download ptb` fetches it (or point LOCALCLIP_DATA at a folder holding ptbdataset/)"
GET_BOTH = ("`localclip data download ptb` and `localclip data download wikitext2` fetch them "
            "(or point LOCALCLIP_DATA at a folder holding ptbdataset/ and wikitext2/)")
GET_FMNIST = "Fashion-MNIST not installed: `apt-get install dataset-fashion-mnist` (files under /usr/share/datasets/fashion-mnist)"


def real_data_root(*names: str) -> Path | None:
    """The data root the CLI resolves, if it holds every corpus in ``names`` (default: all known)."""
    root = resolve_data_root(None)
    wanted = names or tuple(CORPORA)
    if all((root / CORPORA[n].folder / split).is_file() for n in wanted for split in ("train.txt", "valid.txt", "test.txt")):
        return root
    return None


def shared_data_root() -> Path | None:
    """The data root holding both real corpora, or None."""
    return real_data_root()


def write_tiny_ptb(folder: Path, *, train_lines: int = 3000, seed: int = 0) -> Path:
    """A PTB-format corpus (lower-case words, ``<unk>``, ``N``, one sentence a line, a leading
    space as in PTB's files) of about 60,000 training tokens over a 600-word vocabulary."""
    rng = random.Random(seed)
    vocab = ["the", "<unk>", "N", "of", "to", "a", "in", "and", "'s", "that"] + [f"w{i}" for i in range(590)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]  # Zipf-like, as words are
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", train_lines), ("valid", train_lines // 10), ("test", train_lines // 10)):
        text = "".join(" " + " ".join(rng.choices(vocab, weights, k=rng.randint(8, 30))) + " \n" for _ in range(lines))
        (folder / f"{split}.txt").write_text(text, encoding="utf-8")
    return folder


def _tiny_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="localclip-tiny-data-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_tiny_ptb(root / CORPORA["ptb"].folder)
    # A run may name the other corpus (a resume whose config differs in dataset): it is there too.
    write_tiny_ptb(root / CORPORA["wikitext2"].folder, train_lines=300, seed=1)
    return root


REAL_PTB = real_data_root("ptb")
REAL_DATA = real_data_root()
#: A data root holding PTB: the real one when present, else the small corpus.
SHARED: Path = REAL_PTB if REAL_PTB is not None else _tiny_root()
#: True when SHARED holds the small custom corpus: runs on it need --allow-custom-corpus.
CUSTOM = REAL_PTB is None
#: CLI flags that point a run at SHARED.
SMOKE_DATA = ["--data-root", str(SHARED), *(["--allow-custom-corpus"] if CUSTOM else [])]
#: --set / sweep overrides that do the same for the corpus check.
CUSTOM_OVERRIDES = ["allow_custom_corpus=true"] if CUSTOM else []

needs_real_ptb = pytest.mark.skipif(REAL_PTB is None, reason=f"needs the real PTB corpus: {GET_PTB}")
needs_real_data = pytest.mark.skipif(REAL_DATA is None, reason=f"needs the real PTB and WikiText-2 corpora: {GET_BOTH}")
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
HAVE_FMNIST = any((FASHION_MNIST / f"train-images-idx3-ubyte{ext}").exists() for ext in ("", ".gz"))
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason=GET_FMNIST)

__all__ = [
    "CUSTOM", "CUSTOM_OVERRIDES", "FASHION_MNIST", "HAVE_FMNIST", "REAL_DATA", "REAL_PTB", "SHARED", "SMOKE_DATA",
    "needs_fmnist", "needs_real_data", "needs_real_ptb", "real_data_root", "shared_data_root", "write_tiny_ptb",
]

