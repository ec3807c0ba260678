"""What both halves of the ``localclip`` command share (:mod:`localclip.cli` and the lab's
:mod:`localclip_lab.cli`): the argparse types that refuse a bad number in one line, and fetching a
missing corpus on first use.
"""

from __future__ import annotations

import argparse
import math
import sys

__all__ = ["ensure_corpus", "positive_float", "positive_int"]


def positive_int(flag: str):
    """An argparse type for ``flag``: an integer >= 1."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text!r} (expected an integer >= 1)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {value} (expected an integer >= 1)")
        return value

    return parse


def positive_float(flag: str, allow_inf: bool = False):
    """An argparse type for ``flag``: a finite number > 0 (or inf, with ``allow_inf``)."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text!r} (expected a number > 0)") from None
        if not value > 0 or math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"invalid {flag} value: {text} (expected a {'number > 0 or inf' if allow_inf else 'finite number > 0'})")
        return value

    return parse


def ensure_corpus(config) -> None:
    """Fetch a missing known corpus on first use (saying what and where); offline, fail clearly."""
    from localclip import data
    from localclip.errors import DataError

    if config.workload.dataset not in data.CORPORA:
        return
    folder = data.corpus_path(config.workload.dataset, config.workload.data_root)
    if all((folder / f).is_file() for f in ("train.txt", "valid.txt", "test.txt")):
        return
    root = data.resolve_data_root(config.workload.data_root)
    if config.workload.data_root and not root.is_dir():
        # A typo must not become a new folder with a download in it: downloading is asked for.
        raise DataError(
            f"--data-root {root} does not exist. Point it at the folder that holds {folder.name}/, or download "
            f"{config.workload.dataset} there with `localclip data download {config.workload.dataset} --data-root {root}`."
        )
    print(f"localclip: {config.workload.dataset} is not in {folder}; downloading it there (SHA-256 verified)...", file=sys.stderr)
    try:
        data.download_corpus(config.workload.dataset, root, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    except DataError as exc:
        raise DataError(
            f"{config.workload.dataset} is missing from {folder} and could not be downloaded ({exc}) "
            f"Or point --data-root / LOCALCLIP_DATA at a folder that holds {folder.name}/."
        ) from None
