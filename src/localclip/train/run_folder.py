"""The run folder: config, metrics, summary and checkpoints, written so nothing good is lost.

Layout::

    RUN/config.json           the resolved config (written once, when the run starts)
    RUN/metrics.jsonl         one JSON record per line, flushed as written
    RUN/summary.json          written last: its presence marks a finished run
    RUN/checkpoints/latest.json         {"step": S, "world_size": N}: the newest complete set
    RUN/checkpoints/step-S/rank-R.pt    one file per worker
    RUN/tensorboard/          the same records as TensorBoard events, when tensorboard is installed
    RUN/wandb/                an offline Weights & Biases run, with ``--logger wandb``

Every file is written to a temporary name and renamed into place, and ``latest.json`` moves only
after every worker's file of that step exists, so a crash at any moment leaves the previous
checkpoint intact. Only rank 0 writes shared files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from localclip.errors import RunFolderError
from localclip.train.loggers import open_sinks

__all__ = ["RunFolder", "atomic_write_text", "atomic_torch_save"]


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

    # -- state of the folder -------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.summary_path.exists()

    @property
    def started(self) -> bool:
        return self.config_path.exists()

    def latest_checkpoint(self) -> dict | None:
        latest = self.checkpoints / "latest.json"
        if not latest.exists():
            return None
        try:
            return json.loads(latest.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"Unreadable checkpoint index {latest}: {exc}") from exc

    def prepare(self, config_json: str, *, resume: bool, world_size: int) -> dict | None:
        """Check the folder can take this run; return the checkpoint to resume from, if any.

        Refuses (without touching anything) a finished run, an existing run without
        ``resume``, and a resume whose config or number of workers differs.
        """
        if self.finished:
            raise RunFolderError(f"{self.path} holds a finished run (summary.json exists); choose another --out")
        if self.started and not resume:
            raise RunFolderError(f"{self.path} already holds a run; pass --resume to continue it or choose another --out")
        if not self.started:
            return None
        saved = json.loads(self.config_path.read_text())
        new = json.loads(config_json)
        # A field added after the run started ran at its default.
        saved = {**{k: v for k, v in _config_defaults().items() if k in new}, **saved}
        if saved.get("workers") != new.get("workers"):
            raise RunFolderError(
                f"--resume with {new.get('workers')} workers, but the run in {self.path} was started with {saved.get('workers')}"
            )
        ignorable = {"max_steps", "epochs", "timeout", "threads", "data_root", "log_interval", "checkpoint_interval", "loggers"}
        differ = sorted(k for k in set(saved) | set(new) if k not in ignorable and saved.get(k) != new.get(k))
        if differ:
            detail = ", ".join(f"{k}: {saved.get(k)!r} -> {new.get(k)!r}" for k in differ)
            raise RunFolderError(f"--resume with a config that differs from the run in {self.path}: {detail}")
        return self.latest_checkpoint()

    # -- writing (rank 0 only) -----------------------------------------------------------------

    def begin(self, config_json: str, checkpoint: dict | None) -> None:
        """Lay out the folder for a fresh run, or trim it back to the checkpoint resumed from."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        if checkpoint is None:
            atomic_write_text(self.config_path, config_json + "\n")
            if self.metrics_path.exists():
                self.metrics_path.unlink()  # a started run without any checkpoint: nothing to keep
        else:
            self._truncate_metrics(after_step=checkpoint["step"])

    def _truncate_metrics(self, after_step: int) -> None:
        """Drop records newer than the checkpoint: the resumed run writes them again."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if record.get("step", 0) <= after_step:
                kept.append(line)
        atomic_write_text(self.metrics_path, "".join(f"{line}\n" for line in kept))

    def log(self, record: dict) -> None:
        if self._metrics is None:
            self._metrics = open(self.metrics_path, "a", encoding="utf-8")
            self._sinks = open_sinks(self.loggers, self.path)
        self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
        self._metrics.flush()
        for sink in self._sinks:
            sink.log(record)

    def finish(self, summary: dict) -> None:
        self.close()
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_file(self, step: int, rank: int) -> Path:
        return self.checkpoints / f"step-{step}" / f"rank-{rank}.pt"

    def save_worker_checkpoint(self, state: dict, step: int, rank: int) -> None:
        path = self.checkpoint_file(step, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, path)

    def commit_checkpoint(self, step: int, world_size: int) -> None:
        """Point ``latest.json`` at ``step`` (every rank's file exists) and drop older sets."""
        missing = [r for r in range(world_size) if not self.checkpoint_file(step, r).exists()]
        if missing:
            raise RunFolderError(f"checkpoint of step {step} lacks the files of ranks {missing}")
        atomic_write_text(self.checkpoints / "latest.json", json.dumps({"step": step, "world_size": world_size}) + "\n")
        for old in self.checkpoints.glob("step-*"):
            if old.name != f"step-{step}":
                shutil.rmtree(old, ignore_errors=True)

    def load_worker_checkpoint(self, step: int, rank: int) -> dict:
        path = self.checkpoint_file(step, rank)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise RunFolderError(f"rank {rank}: checkpoint file {path} is missing") from None
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise RunFolderError(f"rank {rank}: cannot read checkpoint {path}: {exc}") from exc


def _config_defaults() -> dict:
    from localclip.train.config import TrainConfig

    return json.loads(TrainConfig().to_json())
