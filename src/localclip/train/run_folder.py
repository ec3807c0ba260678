"""The run folder: config, metrics, summary and checkpoints, written so nothing good is lost.

Layout::

    RUN/config.json           the resolved config and the code version (written once, when the run starts)
    RUN/metrics.jsonl         one JSON record per line, flushed as written
    RUN/summary.json          written last: its presence marks a finished run
    RUN/checkpoints/latest.json         the index: the newest complete set first, then older kept ones
    RUN/checkpoints/step-S/rank-R.pt    one file per worker (``step-S-epoch-E`` at the start of epoch E)
    RUN/checkpoints/damaged-step-S/     a set that a resume found damaged, set aside
    RUN/tensorboard/          the same records as TensorBoard events, when tensorboard is installed
    RUN/wandb/                an offline Weights & Biases run, with ``--logger wandb``

While a run (or its resume) is going, the process that started it holds an exclusive lock on the
folder (``flock`` on the directory itself, so no file is added; released when the process ends,
however it ends): a second run or resume into the same folder is refused in one line before it
touches anything, instead of interleaving its records and checkpoints with the first's.

Every file is written to a temporary name and renamed into place, and ``latest.json`` moves only
after every worker's file of that set exists, so a crash at any moment leaves the previous
checkpoints intact. The last ``keep`` complete sets are kept, so that one unreadable file costs
one checkpoint interval, not the run; a set that a resume finds damaged is set aside as
``checkpoints/damaged-step-S`` (:meth:`RunFolder.set_aside`), out of the index, so that it never
counts as one of the kept sets and never displaces a good one. Only rank 0 writes shared files.

An index entry is ``{"step", "dir", "epochs", "metrics_lines"}``: where the set lies, how far
training had got (epochs, fractional) and how many lines ``metrics.jsonl`` had then, so a resume
drops exactly the records written after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: folders are not locked
    fcntl = None

from localclip import jsonio
from localclip.errors import RunFolderError
from localclip.train.loggers import open_sinks

__all__ = ["RESUME_MAY_CHANGE", "RunFolder", "atomic_write_text", "atomic_torch_save"]

#: Config fields a resume may change: the budget, and how the run is observed and hosted.
#: ``provenance`` is compared by :func:`other_code`: a run is made by one code version.
RESUME_MAY_CHANGE = frozenset({
    "provenance", "max_steps", "epochs", "timeout", "threads", "data_root", "log_interval", "checkpoint_interval", "keep_checkpoints", "loggers",
    "stop_check_interval", "stop_on_divergence", "device",
})


def other_code(started: dict | None, now: dict | None) -> str:
    """How the code version ``now`` differs from the one that ``started`` a run ('' if it does not).

    A run's numbers are those of one code version from start to end, so a resume under another
    commit, with uncommitted changes the run was started without, or under another torch is
    refused. Versions unknown on either side (a run from an installed wheel, or from before
    versions were recorded) are not compared."""
    if not started or not now:
        return ""
    differ = []
    if started.get("commit") and now.get("commit") and started["commit"] != now["commit"]:
        differ.append(f"commit {started['commit'][:12]} in the run, {now['commit'][:12]} now")
    if started.get("dirty") is False and now.get("dirty"):
        differ.append("started from a clean checkout, now with uncommitted changes")
    if started.get("torch") and now.get("torch") and started["torch"] != now["torch"]:
        differ.append(f"torch {started['torch']} in the run, {now['torch']} now")
    return "; ".join(differ)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class RunFolder:
    """One training run's folder on disk."""

    def __init__(self, path: str | os.PathLike, loggers=("tensorboard",)):
        self.path = Path(path)
        self.loggers = tuple(loggers)  # sinks beside metrics.jsonl (localclip.train.loggers)
        self.config_path = self.path / "config.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"
        self.checkpoints = self.path / "checkpoints"
        self._metrics = None
        self._sinks: list = []
        self._lines: int | None = None
        self._lock: int | None = None

    # -- the lock --------------------------------------------------------------------------------

    def claim(self) -> None:
        """Take the folder for this process (a no-op if already held or where there is no flock);
        raises :class:`RunFolderError` if another process holds it."""
        if self._lock is not None or fcntl is None:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunFolderError(f"{self.path} is in use by another localclip process (a run or a sweep writing to it); "
                                 "wait for it to end, or choose another --out") from None
        self._lock = fd

    def release(self) -> None:
        """Let the folder go (the process's end does it too)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    # -- state of the folder -------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.summary_path.exists()

    @property
    def started(self) -> bool:
        return self.config_path.exists()

    def read_config(self) -> tuple:
        """``(TrainConfig, provenance)`` of the run: its config, and the code version that started
        it (None for a run made before runs recorded it)."""
        from localclip.train.config import config_from_dict

        try:
            data = json.loads(self.config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"{self.config_path}: unreadable config ({exc})") from exc
        provenance = data.pop("provenance", None)
        return config_from_dict(data), provenance

    def latest_checkpoint(self) -> dict | None:
        """The newest complete checkpoint set's index entry, or None."""
        sets = self.checkpoint_sets()
        return sets[0] if sets else None

    def checkpoint_sets(self) -> list[dict]:
        """The kept complete checkpoint sets, newest first (see the module docstring)."""
        latest = self.checkpoints / "latest.json"
        if not latest.exists():
            return []
        try:
            index = json.loads(latest.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"Unreadable checkpoint index {latest}: {exc}") from exc
        if "checkpoints" in index:
            return index["checkpoints"]
        return [{"step": index["step"], "dir": f"step-{index['step']}"}]  # the index of older versions

    def prepare(self, config_json: str, *, resume: bool) -> list[dict]:
        """Check the folder can take this run; return the checkpoint sets to resume from (newest
        first; empty for a fresh run). Raises :class:`RunFolderError`, touching nothing, for:
        a path that is a file; an existing run without ``resume``; a resume whose config differs
        (naming every differing field with both values); a resume whose budget (``max_steps``,
        ``epochs``) is smaller than what was already done, or, for a finished run, not larger.
        """
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"--out {self.path} is a file, not a run folder; choose another --out")
        if self.path.is_dir():
            self.claim()
        if self.started and not resume:
            what = "a finished run (summary.json exists)" if self.finished else "a run"
            extend = "; to continue it with a larger --max-steps/--epochs, pass --resume" if self.finished else "; pass --resume to continue it"
            raise RunFolderError(f"{self.path} already holds {what}{extend}, or choose another --out")
        if not self.started:
            return []
        try:
            saved = jsonio.loads(self.config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"Unreadable run config {self.config_path}: {exc}") from exc
        # Compared under the flat names, so that a run whose config.json is flat (as the runs
        # committed under results/ are) compares with a config in sections field by field.
        from localclip.train.config import flat_view

        saved, new = flat_view(saved), flat_view(jsonio.loads(config_json))
        other = other_code(saved.get("provenance"), new.get("provenance"))
        if other:
            raise RunFolderError(f"--resume under other code than the run in {self.path} was started by: {other}; "
                                 "resume it from a checkout at its commit (git worktree add DIR COMMIT)")
        # A field added after the run started ran at its default.
        saved = {**{k: v for k, v in _config_defaults().items() if k in new}, **saved}
        differ = sorted(k for k in set(saved) | set(new) if k not in RESUME_MAY_CHANGE and saved.get(k) != new.get(k))
        if differ:
            detail = "; ".join(f"{k}: {saved.get(k)!r} in the run, {new.get(k)!r} now" for k in differ)
            raise RunFolderError(f"--resume with a config that differs from the run in {self.path}: {detail}")
        sets = self.checkpoint_sets()
        self._check_budget(new, sets)
        return sets

    def _check_budget(self, new: dict, sets: list[dict]) -> None:
        max_steps, epochs = new.get("max_steps"), new.get("epochs")
        if self.finished:
            try:
                summary = jsonio.loads(self.summary_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise RunFolderError(f"Unreadable summary {self.summary_path}: {exc}") from exc
            steps, done = summary.get("steps", 0), summary.get("epochs", 0.0)
            how = f"{self.path} holds a finished run ({steps} steps, {done:g} epochs)"
            if max_steps is not None and max_steps <= steps:
                raise RunFolderError(f"{how}: --max-steps {max_steps} does not extend it; give more than {steps}")
            if epochs <= done + 1e-9:
                raise RunFolderError(f"{how}: --epochs {epochs:g} does not extend it; give more than {done:g}")
            return
        if not sets:
            return
        newest = sets[0]
        if max_steps is not None and max_steps < newest["step"]:
            raise RunFolderError(
                f"--max-steps {max_steps} is smaller than the {newest['step']} steps the run in {self.path} already did; nothing changed"
            )
        if newest.get("epochs") is not None and epochs < newest["epochs"] - 1e-9:
            raise RunFolderError(
                f"--epochs {epochs:g} is smaller than the {newest['epochs']:g} epochs the run in {self.path} already did; nothing changed"
            )

    # -- writing (rank 0 only) -----------------------------------------------------------------

    def begin(self, config_json: str, resuming: bool) -> None:
        """Lay out the folder for a fresh run; a resumed one is trimmed later, by
        :meth:`rewind`, once the workers have agreed on the checkpoint."""
        if resuming:
            return
        # The folders this creates, outermost first: removed again if the run cannot start.
        self.created = [p for p in (*reversed(self.path.parents), self.path) if not p.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.claim()  # before anything is written: of two processes starting the same fresh run, one goes on
            self.checkpoints.mkdir(exist_ok=True)
            atomic_write_text(self.config_path, config_json + "\n")
        except RunFolderError:
            self.created = []  # the folder is the other process's
            raise
        except OSError as exc:
            self.remove_created()
            raise RunFolderError(f"--out {self.path}: cannot write the run folder there ({exc.strerror or exc})") from None
        if self.metrics_path.exists():
            self.metrics_path.unlink()  # a started run without any checkpoint: nothing to keep

    def remove_created(self) -> None:
        """Undo :meth:`begin` for a run that could not start: remove what it created, provided
        the run wrote nothing besides its config (no record, no checkpoint)."""
        created = getattr(self, "created", [])
        if not created or self.metrics_lines or self.checkpoint_sets():
            return
        for name in ("config.json", ".config.json.tmp"):
            with contextlib.suppress(OSError):
                (self.path / name).unlink()
        with contextlib.suppress(OSError):
            self.checkpoints.rmdir()
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                break  # not empty: something else is there

    def rewind(self, entry: dict) -> None:
        """Drop the records written after checkpoint ``entry``: the resumed run writes them again."""
        self._lines = 0
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        if entry.get("metrics_lines") is not None:
            kept = lines[: entry["metrics_lines"]]
        else:  # an index of older versions: records up to the checkpoint's step
            kept = []
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if record.get("step", 0) <= entry["step"]:
                    kept.append(line)
        atomic_write_text(self.metrics_path, "".join(f"{line}\n" for line in kept))
        self._lines = len(kept)

    @property
    def metrics_lines(self) -> int:
        """Lines of ``metrics.jsonl`` so far (counted once, then kept up to date by :meth:`log`)."""
        if self._lines is None:
            self._lines = len(self.metrics_path.read_bytes().splitlines()) if self.metrics_path.exists() else 0
        return self._lines

    def log(self, record: dict) -> None:
        if self._metrics is None:
            self._metrics = open(self.metrics_path, "a", encoding="utf-8")
            self._sinks = open_sinks(self.loggers, self.path)
        lines = self.metrics_lines
        self._metrics.write(jsonio.dumps(record, sort_keys=True) + "\n")
        self._metrics.flush()
        self._lines = lines + 1
        for sink in self._sinks:
            sink.log(record)

    def finish(self, summary: dict) -> None:
        self.close()
        # Every worker is past its last checkpoint (the final averaging waited for all): the
        # leftovers of an abandoned continuation that the run never passed can go now.
        self._drop_sets(keep={e["dir"] for e in self.checkpoint_sets()})
        atomic_write_text(self.summary_path, jsonio.dumps(summary, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_file(self, name: str, rank: int) -> Path:
        return self.checkpoints / name / f"rank-{rank}.pt"

    def save_worker_checkpoint(self, state: dict, name: str, rank: int) -> None:
        path = self.checkpoint_file(name, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, path)

    def commit_checkpoint(self, step: int, world_size: int, *, name: str | None = None, epochs: float | None = None, keep: int = 2,
                          metrics_lines: int | None = None) -> None:
        """Put set ``name`` (every rank's file exists) first in the index, keep the newest
        ``keep`` sets and delete the other folders up to this step. Newer index entries are
        dropped (after a resume from an older set they belong to the abandoned continuation),
        but newer folders are left on disk: between rounds the workers do not wait for each
        other, so past the barrier before this commit another rank may already be writing its
        file of the next set, and deleting that folder would make the next commit find the
        rank's file missing. A newer leftover is deleted by the first commit that passes its
        step, or by :meth:`finish`; it is never resumed from, as only the index names sets.
        ``metrics_lines``: the lines ``metrics.jsonl`` had when the state was taken (default: now)."""
        name = name or f"step-{step}"
        missing = [r for r in range(world_size) if not self.checkpoint_file(name, r).exists()]
        if missing:
            raise RunFolderError(f"checkpoint {name} lacks the files of ranks {missing}")
        lines = self.metrics_lines if metrics_lines is None else metrics_lines
        entry = {"step": step, "dir": name, "epochs": epochs, "metrics_lines": lines}
        older = [e for e in self.checkpoint_sets() if e["dir"] != name and e["step"] <= step]
        kept = [entry, *older][:keep]
        index = {"step": step, "world_size": world_size, "dir": name, "checkpoints": kept}
        atomic_write_text(self.checkpoints / "latest.json", json.dumps(index) + "\n")
        self._drop_sets(keep={e["dir"] for e in kept}, up_to=step)

    def _drop_sets(self, keep: set[str], up_to: int | None = None) -> None:
        """Delete the set folders not in ``keep`` (only those of step ``up_to`` or earlier, if given)."""
        for old in self.checkpoints.glob("step-*"):
            if old.name in keep:
                continue
            if up_to is not None and _step_of(old.name) > up_to:
                continue  # perhaps being written right now by a rank that went on (see commit_checkpoint)
            shutil.rmtree(old, ignore_errors=True)

    def drop_set(self, name: str) -> None:
        """Delete set ``name``, which no index names (a set never committed)."""
        if name not in {e["dir"] for e in self.checkpoint_sets()}:
            shutil.rmtree(self.checkpoints / name, ignore_errors=True)

    def load_worker_checkpoint(self, name: str, rank: int) -> dict:
        path = self.checkpoint_file(name, rank)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the unpickler's notes on a damaged file's pickle protocol
                return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise RunFolderError(f"rank {rank}: checkpoint file {path} is missing") from None
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise RunFolderError(f"rank {rank}: cannot read checkpoint {path}: damaged ({_why_unreadable(exc)})") from None

    def set_aside(self, names: list[str]) -> list[Path]:
        """Take the damaged sets ``names`` out of the index and rename their folders
        ``damaged-step-S...`` (kept for a look, never counted among the kept sets nor resumed
        from nor pruned); returns the new paths. The index moves first: a crash in between
        leaves a folder that no index names, which the next commit past its step deletes."""
        names = [n for n in names if (self.checkpoints / n).is_dir()]
        if not names:
            return []
        latest = self.checkpoints / "latest.json"
        index = json.loads(latest.read_text())
        kept = [e for e in self.checkpoint_sets() if e["dir"] not in names]
        if kept:
            index.update(step=kept[0]["step"], dir=kept[0]["dir"], checkpoints=kept)
        else:
            index["checkpoints"] = []
        atomic_write_text(latest, json.dumps(index) + "\n")
        moved = []
        for name in names:
            target = self.checkpoints / f"damaged-{name}"
            n = 1
            while target.exists():
                n += 1
                target = self.checkpoints / f"damaged-{name}.{n}"
            os.replace(self.checkpoints / name, target)
            moved.append(target)
        return moved


def _why_unreadable(exc: BaseException) -> str:
    """One line on why torch could not load a checkpoint file: the cause, without torch's
    advice (retrying with ``weights_only=False``, filing an issue) that fits a file from
    elsewhere, not a run's own file cut short or overwritten."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        detail = next((line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()), "")
        return f"not a checkpoint torch can read: {detail}" if detail else "not a checkpoint torch can read"
    if isinstance(exc, EOFError):
        return "the file ends early"
    first = text.strip().splitlines()[0].split(". ")[0] if text.strip() else type(exc).__name__
    return first


def _step_of(name: str) -> float:
    """The step of a set folder ``step-S`` or ``step-S-epoch-E`` (infinity for another name:
    never taken for an old set)."""
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return float("inf")


def _config_defaults() -> dict:
    from localclip.train.config import TrainConfig, flat_view

    return flat_view(jsonio.loads(TrainConfig().to_json()))
