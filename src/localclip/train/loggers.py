"""Where a run's metric records go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``metrics.jsonl`` is always written (it is what ``localclip plot`` and ``report`` read); the
config's ``loggers`` add sinks: ``tensorboard`` (the default, used when the ``tensorboard``
package is installed, silently skipped otherwise) and ``wandb`` (asked for explicitly, so a
missing ``wandb`` package is an error before the run starts). W&B runs offline, into
``RUN/wandb``; ``wandb sync RUN/wandb/offline-run-*`` uploads them later.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from localclip import jsonio
from localclip.errors import ConfigError

__all__ = ["LOGGERS", "check_loggers", "open_sinks"]

LOGGERS = ("tensorboard", "wandb")


def check_loggers(names) -> None:
    """Reject unknown logger names, and ``wandb`` when the package is missing."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"Invalid loggers: {names!r} (expected a list of names from {', '.join(LOGGERS)})")
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"Invalid logger {unknown[0]!r} (expected one of {', '.join(LOGGERS)})")
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--logger wandb needs the wandb package: pip install 'localclip[wandb]'")


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "final")}


class TensorBoardSink:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def log(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline W&B run named after the run folder, with the resolved config attached."""

    def __init__(self, folder: Path):
        import wandb

        config_path = folder / "config.json"
        config = jsonio.loads(config_path.read_text()) if config_path.exists() else {}
        (folder / "wandb").mkdir(exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(folder), project="localclip", name=folder.name, config=config,
                              reinit="create_new")

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(names, folder: Path) -> list:
    """The sinks for ``names`` in ``folder``; TensorBoard is skipped when not installed."""
    sinks = []
    for name in names:
        if name == "tensorboard":
            if importlib.util.find_spec("tensorboard") is not None:
                sinks.append(TensorBoardSink(folder))
        elif name == "wandb":
            sinks.append(WandbSink(folder))
    return sinks
