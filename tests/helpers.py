"""What tests share: where they find data, the small corpus they make when the real one is
absent, and the helpers of short CLI runs (flags, kill-and-resume, comparing two runs).

The real corpora are found one way, the way the ``localclip`` command finds them
(:func:`localclip.data.resolve_data_root`: ``$LOCALCLIP_DATA``, else the user cache
``$XDG_CACHE_HOME/localclip/data`` or ``~/.cache/localclip/data``); conftest.py points
``LOCALCLIP_DATA`` at a ``shared/data`` folder beside the checkout when there is one and the
variable is unset.

Tests that need a corpus only to exercise code (training, parity, resume, interrupts, bad input,
sweeps) use :data:`SHARED`: the real root when PTB is there, else a folder holding a small
PTB-format corpus written once per test session (a custom corpus: such runs pass
``--allow-custom-corpus``, which :data:`CUSTOM` and :data:`SMOKE_DATA` carry). Only tests that
check the real corpus itself, or a number computed on it, skip without it
(:data:`needs_real_ptb`, :data:`needs_real_data`, which also put them in the full suite) and then
read it from :data:`REAL_PTB` or :data:`REAL_DATA`, which their guard makes non-None.
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
#: The checkout's root folder (tests/ is in it).
REPO = Path(__file__).resolve().parents[1]
#: A data root holding PTB: the real one when present, else the small corpus.
SHARED: Path = REAL_PTB if REAL_PTB is not None else _tiny_root()
#: True when SHARED holds the small custom corpus: runs on it need --allow-custom-corpus.
CUSTOM = REAL_PTB is None
#: CLI flags that point a run at SHARED.
SMOKE_DATA = ["--data-root", str(SHARED), *(["--allow-custom-corpus"] if CUSTOM else [])]
#: --set / sweep overrides that do the same for the corpus check.
CUSTOM_OVERRIDES = ["allow_custom_corpus=true"] if CUSTOM else []

#: Flags of a short ``localclip train`` on SHARED: no progress bar, a small evaluation, a record every 3 steps.
SMOKE = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=2000", "--set", "log_interval=3"]
#: --set overrides of a small sweep's runs. Two workers, a few steps, a 2,000-token evaluation:
#: seconds per run on a 2-core machine. One intra-op thread: on a machine shared with other runs,
#: two threads per op cost more than they gain.
SMALL = ["workers=2", "eval_tokens=2000", "log_interval=2", "eval_interval=0", "checkpoint_interval=4", "threads=1", *CUSTOM_OVERRIDES]


def _needs_real(root: Path | None, reason: str):
    """A test of the real corpora: skipped without them, and in the full suite only (the fast
    tier must run, and mean the same, on a newcomer's machine)."""
    skip = pytest.mark.skipif(root is None, reason=reason)
    return lambda test: pytest.mark.full(skip(test))


needs_real_ptb = _needs_real(REAL_PTB, f"needs the real PTB corpus: {GET_PTB}")
needs_real_data = _needs_real(REAL_DATA, f"needs the real PTB and WikiText-2 corpora: {GET_BOTH}")
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
HAVE_FMNIST = any((FASHION_MNIST / f"train-images-idx3-ubyte{ext}").exists() for ext in ("", ".gz"))
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason=GET_FMNIST)


def train(tmp_path, *args, name="run"):
    """``localclip train ptb-small ARGS`` into ``tmp_path/name`` with :data:`SMOKE`; returns (exit status, folder)."""
    from localclip.cli import main

    out = tmp_path / name
    code = main(["train", "ptb-small", *args, "--out", str(out), *SMOKE])
    return code, out


def records(out: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl."""
    from localclip import jsonio

    return [jsonio.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def timeless_summary(out: Path) -> dict:
    """A run's summary.json without its wall-clock keys (``time/...``)."""
    return {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if not k.startswith("time/")}


def timeless_records(out: Path) -> list[dict]:
    """A run's metrics.jsonl records without their wall-clock keys (``time/...``)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]


def assert_same_run(a: Path, b: Path) -> None:
    """Two run folders hold the same numbers: summary and every record, wall-clock times aside."""
    assert timeless_summary(a) == timeless_summary(b)
    assert timeless_records(a) == timeless_records(b)


def kill_after_first_checkpoint(train_args: list[str], out: Path, poll: float = 0.05) -> Path:
    """Start ``localclip train TRAIN_ARGS --out OUT`` in a process, SIGKILL it once its first
    checkpoint is written (or after 120 s), and check it had not finished; returns
    ``latest.json``."""
    cmd = [sys.executable, "-m", "localclip.cli", "train", *train_args, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = out / "checkpoints" / "latest.json"
    deadline = time.monotonic() + 120
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (out / "summary.json").exists(), "the run finished before it could be killed"
    return latest


__all__ = [
    "CUSTOM", "CUSTOM_OVERRIDES", "FASHION_MNIST", "HAVE_FMNIST", "REAL_DATA", "REAL_PTB", "REPO", "RecordingBar", "SHARED", "SMALL", "SMOKE",
    "SMOKE_DATA", "assert_same_run", "kill_after_first_checkpoint", "needs_fmnist", "needs_real_data", "needs_real_ptb",
    "real_data_root", "records", "timeless_records", "timeless_summary", "train", "write_tiny_ptb",
]


class RecordingBar:
    """Stands in for tqdm and keeps what the trainer told it."""

    instances = []

    def __init__(self, **kwargs):
        self.total, self.n, self.postfixes, self.closed = kwargs.get("total"), kwargs.get("initial", 0), [], False
        RecordingBar.instances.append(self)

    def update(self, k=1):
        self.n += k

    def refresh(self):
        pass

    def set_postfix(self, refresh=True, **kw):
        self.postfixes.append(kw)

    def set_postfix_str(self, text, refresh=True):
        self.postfixes.append(text)

    def close(self):
        self.closed = True


class FtWorkers:
    """Worker processes of a fault-tolerant run (tests/comm/ft_worker.py) over a lighthouse of
    their own; they write their records to ``out``. Each process this starts is signalled and
    reaped only by its pid; :meth:`close` kills the ones still running and stops the lighthouse.

    ``start(rank, **options)`` starts worker ``rank`` (options: ``ft_worker.py``'s flags, ``_``
    for ``-``) and returns its ``Popen``; :meth:`records` reads a worker's records, across its
    restarts (a restart appends to the same file)."""

    WORKER = Path(__file__).parent / "comm" / "ft_worker.py"

    def __init__(self, out: Path, world: int = 3, *, min_replicas: int = 2, join_timeout: float = 2.0, heartbeat_timeout: float = 2.0):
        import os

        from localclip.comm import ft

        self.out, self.world = Path(out), world
        self.lighthouse = ft.start_lighthouse(min_replicas=min_replicas, join_timeout=join_timeout, heartbeat_timeout=heartbeat_timeout)
        self.started: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": str(Path(ft.__file__).resolve().parents[2])}

    def start(self, rank: int, **options) -> subprocess.Popen:
        flags = []
        for name, value in {"steps": 40, "sleep": 0.05, "timeout": 20.0, **options}.items():
            flags += [f"--{name.replace('_', '-')}", str(value)]
        with open(self.out / f"stderr{rank}-{len(self.started)}.txt", "w") as err:
            proc = subprocess.Popen([sys.executable, str(self.WORKER), "--rank", str(rank), "--world", str(self.world),
                                     "--lighthouse", self.lighthouse.address(), "--out", str(self.out), *flags],
                                    env=self.env, stdout=subprocess.DEVNULL, stderr=err)
        self.started.append(proc)
        return proc

    def start_together(self, **options) -> list[subprocess.Popen]:
        """Start every worker, and let them ask for their first quorum only once all of them
        are up (a loaded machine may take a minute to start one), so that the first quorum
        holds them all."""
        gate = self.out / "start-gate"
        procs = [self.start(rank, start_gate=gate, **options) for rank in range(self.world)]
        wait_until(lambda: all(any("started" in r for r in self.records(rank)) or procs[rank].poll() is not None
                               for rank in range(self.world)), "every worker to start", 900)
        gate.touch()
        return procs

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        """Send ``sig`` to a process this started (by its pid)."""
        import os

        assert proc in self.started and proc.poll() is None
        os.kill(proc.pid, sig)

    def records(self, rank: int) -> list[dict]:
        path = self.out / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []

    def stderr(self) -> str:
        """Every started process's stderr, for a failure's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.out.glob("stderr*.txt")))

    def waiting(self) -> int:
        """How many workers wait at the lighthouse for a quorum now (its status page's
        ``[healthy/waiting participants healthy]``)."""
        import re
        import urllib.request

        page = urllib.request.urlopen(f"{self.lighthouse.address()}/status", timeout=30).read().decode()
        match = re.search(r"\[(\d+)/(\d+) participants healthy\]", page)
        assert match, f"the lighthouse's status page has changed: {page[:300]}"
        return int(match.group(2))

    def close(self) -> None:
        import os

        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.lighthouse.shutdown()


def wait_until(predicate, what: str, limit: float, poll: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; an AssertionError naming ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:g}s waiting for {what}")
        time.sleep(poll)
