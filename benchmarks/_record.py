"""Where a benchmark's output is kept: its printed table, with the machine and the code that
produced it, in a file under ``benchmarks/results/``.

Every ``benchmarks/*.py`` runs its ``main`` inside :func:`recorded`: what it prints still goes to
the terminal, and when it finishes (an exception leaves no file) the same text is written to
``benchmarks/results/<script>-<UTC time>.txt`` below a header that names the command, the CPU
model, the thread count, the load average at the start and at the end, the torch version and
the commit with a dirty flag. A run never overwrites an earlier file: docs/benchmarks.md cites
each number's file by name. The dirty flag covers ``src/`` and ``benchmarks/`` (the code a
benchmark runs), not the results folder itself; the commit, CPU and versions come from
:func:`localclip.provenance.code_version`, the record every training run keeps.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent


class _Tee(io.TextIOBase):
    """Write to the terminal and keep a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def fileno(self):
        return self.stream.fileno()

    def isatty(self):
        return self.stream.isatty()


def _dirty() -> bool | None:
    """Whether ``src/`` or ``benchmarks/`` (outside ``benchmarks/results/``) has uncommitted
    changes, untracked files included; None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "benchmarks", ":(exclude)benchmarks/results"],
            cwd=REPO, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(done.stdout.strip()) if done.returncode == 0 else None


def header(name: str, argv: list[str], load_start: tuple, started: datetime.datetime) -> str:
    """The lines above a recorded table: command, machine, threads, load, versions, commit."""
    import torch

    from localclip.provenance import code_version

    version = code_version()
    end = os.getloadavg()
    load = lambda la: " ".join(f"{x:.2f}" for x in la)  # noqa: E731
    lines = [
        f"command: PYTHONPATH=src python benchmarks/{name}.py {shlex.join(argv)}".rstrip(),
        f"started: {started:%Y-%m-%d %H:%M:%S} UTC; finished {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} UTC",
        f"cpu: {version['cpu']} ({os.cpu_count()} logical cpus, {len(os.sched_getaffinity(0))} usable; "
        f"ATen {version['cpu_capability']}); torch threads at the end: {torch.get_num_threads()}",
        f"load average (1, 5, 15 min): {load(load_start)} at the start, {load(end)} at the end",
        f"torch {version['torch']}, python {version['python']}, localclip {version['localclip']}",
        f"commit: {version['commit']} (src/ or benchmarks/ changed since: {_dirty()})",
    ]
    return "".join(f"# {line}\n" for line in lines)


@contextlib.contextmanager
def recorded(name: str, argv: list[str] | None = None):
    """Run the body with its printed output recorded; on a normal exit write the file and say
    where. ``name``: the script's name without ``.py``; ``argv``: its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    text = header(name, argv, load_start, started) + tee.copy.getvalue()
    RESULTS.mkdir(exist_ok=True)
    stem = f"{name}-{started:%Y-%m-%dT%H%M%S}"
    path = RESULTS / f"{stem}.txt"
    n = 1
    while path.exists():  # never overwrite an earlier record
        n += 1
        path = RESULTS / f"{stem}-{n}.txt"
    path.write_text(text, encoding="utf-8")
    print(f"recorded in {path.relative_to(REPO)}")


def run(name: str, main, argv: list[str] | None = None):
    """``sys.exit(run("bench_x", main))``: call ``main(argv)`` (or ``main()`` without argv)
    inside :func:`recorded` and return its exit status."""
    with recorded(name, argv):
        status = main(argv) if argv is not None else main()
        if status:
            print(f"exit status {status}")
    return status
