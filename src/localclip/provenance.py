"""Which code produced a run: the commit, whether the source had uncommitted changes, the
versions of localclip, PyTorch and Python, and the CPU whose float kernels computed it.

The CPU belongs here because the same code gives other bits on another CPU type: MKL and ATen
choose their vectorised kernels by instruction set (``cpu_capability``, torch's name for the one
ATen uses; ``mkl_cbwr``, the ``MKL_CBWR`` setting that pins MKL's branch, when set), and a
different kernel sums in a different order. Runs made on another machine, rerun with the same
code on an AVX-512 Xeon, moved by 3e-6 to 5e-5 (relative) in their first 18-36 steps' training
loss, and agreed to 3e-8 with ``MKL_CBWR=COMPATIBLE``.

Every run records this in ``config.json`` (the code that started it) and in ``summary.json`` (the
code that finished it; the two differ when a run was resumed under other code). "Dirty" looks
at the package's source tree only (``src/`` of the checkout, untracked files included), not at
result files that runs and reports write into the same repository. Outside a git checkout (an
installed wheel) ``commit`` and ``dirty`` are ``None``.
"""

from __future__ import annotations

import functools
import os
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


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """``{"commit", "dirty", "localclip", "torch", "python", "cpu", "cpu_capability", "mkl_cbwr"}``
    for the code and machine running now (cached: neither changes under a running process)."""
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
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
    }
