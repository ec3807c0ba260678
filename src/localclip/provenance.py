"""Which code produced a run: the commit, whether the source had uncommitted changes, and the
versions of localclip, PyTorch and Python.

Every run records this in ``config.json`` (the code that started it) and in ``summary.json`` (the
code that finished it; the two differ when a run was resumed under other code). "Dirty" looks
at the package's source tree only (``src/`` of the checkout, untracked files included), not at
result files that runs and reports write into the same repository. Outside a git checkout (an
installed wheel) ``commit`` and ``dirty`` are ``None``.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

__all__ = ["code_version"]


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """``{"commit", "dirty", "localclip", "torch", "python"}`` for the code running now (cached:
    the source of a running process does not change under it)."""
    import torch

    import localclip

    package = Path(localclip.__file__).resolve().parent
    top = _git(package, "rev-parse", "--show-toplevel")
    commit = dirty = None
    if top is not None:
        root = Path(top.strip())
        head = _git(root, "rev-parse", "HEAD")
        commit = head.strip() if head else None
        source = package.relative_to(root).parent.as_posix() if package.is_relative_to(root) else "."
        status = _git(root, "status", "--porcelain", "--", source)
        dirty = None if status is None else bool(status.strip())
    return {
        "commit": commit,
        "dirty": dirty,
        "localclip": localclip.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
