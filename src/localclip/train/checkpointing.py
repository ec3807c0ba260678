"""A worker's checkpoints: what one holds, when one is written, and which one a resume starts from.

A checkpoint holds everything the worker's next step and next records depend on (step and
epoch, model, algorithm, the workload's position in its stream, the worker's random stream, the
NT-ASGD-like average and the running statistics), so that a resumed run is bit-identical to an
uninterrupted one. The loop writes one every ``checkpoint_interval`` steps (:meth:`Checkpointer.due`),
at the start of each epoch, at a stop request, and when the budget (``max_steps``, ``epochs``)
runs out, before the final averaging, so that a larger budget continues a finished run exactly
where a straight run with that budget would be; a state already on disk is not written again.
A diverged state is never a checkpoint: the end of a budget's set is written before the final
averaging but enters the index only once the final evaluation shows a finite loss, and is deleted
otherwise (:meth:`Checkpointer.hold`); no checkpoint follows a validation that found the model diverged.
Every rank saves its own file with every tensor on the CPU, so a checkpoint loads on any device;
rank 0 moves the index once every rank's file exists. Where the files lie and which sets are
kept is the run folder's (:class:`~localclip.train.run_folder.RunFolder`). A resume takes the
newest kept set that loads on every worker (:func:`agree_on_checkpoint`), and the sets that did
not load are set aside (:meth:`~localclip.train.run_folder.RunFolder.set_aside`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

import torch

from localclip import devices
from localclip.errors import RunFolderError

if TYPE_CHECKING:
    from localclip.train.asgd import EpochAverage
    from localclip.train.metrics import RunMetrics
    from localclip.train.run_folder import RunFolder

__all__ = ["Checkpointer", "Worker", "agree_on_checkpoint", "worker_state"]


class Worker(Protocol):
    """The parts of a worker that its checkpoint holds or is named by
    (:class:`~localclip.train.trainer.Trainer` is one)."""

    step: int
    epoch: int
    position: int  # batches done in this epoch
    device: torch.device
    model: torch.nn.Module
    algorithm: Any
    workload: Any
    generator: torch.Generator
    epoch_average: EpochAverage
    metrics: RunMetrics

    def epoch_progress(self) -> float: ...

    def workload_position(self) -> int: ...


def worker_state(trainer: Worker) -> dict:
    """What this worker's checkpoint holds."""
    return {
        "step": trainer.step,
        "epoch": trainer.epoch,
        "model": trainer.model.state_dict(),
        "algorithm": trainer.algorithm.state_dict(),
        "workload": trainer.workload.state_dict(),
        "rng": trainer.generator.get_state(),
        **trainer.epoch_average.state_dict(),
        **trainer.metrics.state_dict(),
    }


def _load_worker_state(trainer: Worker, state: dict) -> None:
    """Put :func:`worker_state` back (the epoch's batches set up already)."""
    with torch.no_grad():
        trainer.model.load_state_dict(state["model"])
    trainer.algorithm.load_state_dict(state["algorithm"])
    trainer.workload.load_state_dict(state["workload"])
    trainer.step = state["step"]
    trainer.epoch_average.load_state_dict(state, trainer.device)
    trainer.metrics.load_state_dict(state)
    trainer.generator.set_state(state["rng"])
    trainer.position = trainer.workload_position()


class Checkpointer:
    """Writes and restores one worker's checkpoints in ``run_folder`` (None: writes none)."""

    def __init__(self, run_folder: RunFolder | None, comm, *, interval: int, keep: int):
        self.run_folder, self.comm = run_folder, comm
        self.interval, self.keep = interval, keep
        self._pending: dict | None = None  # the checkpoint to resume from, not restored yet
        self._held: tuple | None = None  # a set written by hold(), not in the index yet
        self._saved_at: tuple | None = None  # (step, epoch, position) of the last checkpoint written or restored

    def discard_pending(self) -> None:
        """Forget the checkpoint a resume would restore (a fault-tolerant joiner took a live peer's state instead)."""
        self._pending = None

    def due(self, step: int) -> bool:
        """Whether the interval asks for a checkpoint after ``step`` steps."""
        return step % self.interval == 0

    def save(self, trainer: Worker) -> None:
        """Write the trainer's state (every rank calls this at the same point)."""
        if self.run_folder is None:
            return
        here = (trainer.step, trainer.epoch, trainer.position)
        if here == self._saved_at:
            return  # this very state is already on disk (just written, or resumed from)
        self._write(here, self._name(trainer), devices.to_cpu(worker_state(trainer)), trainer.epoch_progress())

    def hold(self, trainer: Worker) -> None:
        """Write the trainer's state now, but put it in the index only at :meth:`write_held`,
        once it is known not to have diverged (the end of a budget: the final evaluation tells);
        :meth:`drop_held` deletes it instead. Every rank calls these at the same points; until
        then the set is a folder that no index names, never resumed from."""
        self._held = None
        if self.run_folder is None:
            return
        here = (trainer.step, trainer.epoch, trainer.position)
        if here == self._saved_at:
            return
        name = self._name(trainer)
        self.run_folder.save_worker_checkpoint(devices.to_cpu(worker_state(trainer)), name, self.comm.rank)
        self.comm.barrier()  # every rank's file exists before latest.json moves
        lines = self.run_folder.metrics_lines if self.comm.rank == 0 else None
        self._held = (here, name, trainer.epoch_progress(), lines)

    def write_held(self) -> None:
        """Put the set written by :meth:`hold` in the index (rank 0; every rank calls this)."""
        if self._held is None:
            return
        here, name, epochs, lines = self._held
        self._held = None
        if self.comm.rank == 0:
            self.run_folder.commit_checkpoint(here[0], self.comm.world_size, name=name, epochs=epochs, keep=self.keep, metrics_lines=lines)
        self._saved_at = here

    def drop_held(self) -> None:
        """Delete the set written by :meth:`hold`: it diverged, and a diverged state is never a checkpoint."""
        if self._held is None:
            return
        name = self._held[1]
        self._held = None
        if self.comm.rank == 0:
            self.run_folder.drop_set(name)

    def _name(self, trainer: Worker) -> str:
        # The start of an epoch gets its own name: the last step of the previous epoch may
        # have a checkpoint of its own, a different state at the same step.
        return f"step-{trainer.step}-epoch-{trainer.epoch}" if trainer.position == 0 and trainer.epoch > 0 else f"step-{trainer.step}"

    def _write(self, here: tuple, name: str, state, epochs: float) -> None:
        self.run_folder.save_worker_checkpoint(state, name, self.comm.rank)
        self.comm.barrier()  # every rank's file exists before latest.json moves
        if self.comm.rank == 0:
            self.run_folder.commit_checkpoint(here[0], self.comm.world_size, name=name, epochs=epochs, keep=self.keep)
        self._saved_at = here

    def resume(self, state: dict) -> None:
        """Resume from ``state``: restored by :meth:`restore_pending`, once its epoch's batches are set up."""
        self._pending = state

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def restore_pending(self, trainer: Worker) -> bool:
        """Restore the checkpoint given to :meth:`resume`, if not done yet; whether it did."""
        if self._pending is None:
            return False
        _load_worker_state(trainer, self._pending)
        self._pending = None
        self._saved_at = (trainer.step, trainer.epoch, trainer.position)
        return True


def agree_on_checkpoint(comm, run: RunFolder, checkpoints: list[dict]) -> tuple[dict, dict]:
    """Load this worker's file of each kept set (``checkpoints``, newest first); one all-reduce
    tells everyone which sets failed anywhere; every worker takes the newest set that loaded
    everywhere. Returns its index entry and this worker's state."""
    states, failures = [], []
    for entry in checkpoints:
        try:
            states.append(run.load_worker_checkpoint(entry["dir"], comm.rank))
            failures.append(0.0)
        except RunFolderError as exc:
            states.append(None)
            failures.append(1.0)
            print(f"localclip: warning: {exc}", file=sys.stderr, flush=True)
    flags = torch.tensor(failures)
    comm.all_reduce([flags], op="max")
    damaged = [e["dir"] for e, failed in zip(checkpoints, flags.tolist()) if failed]
    for entry, state, failed in zip(checkpoints, states, flags.tolist()):
        if not failed:
            if entry is not checkpoints[0] and comm.rank == 0:
                print(f"localclip: warning: resuming from the older checkpoint {entry['dir']}: a newer one does not load on every worker",
                      file=sys.stderr, flush=True)
            if damaged and comm.rank == 0:
                # Every worker has read its files (the all-reduce came after): the damaged sets
                # can go out of the index, so that they never count among the kept ones.
                moved = run.set_aside(damaged)
                print(f"localclip: warning: set aside the damaged checkpoint{'s' if len(moved) > 1 else ''} "
                      f"{', '.join(str(p) for p in moved)}", file=sys.stderr, flush=True)
            return entry, state
    names = ", ".join(e["dir"] for e in checkpoints)
    # Every set is left where it is, for the user to look at: a resume has nothing to start from.
    raise RunFolderError(f"rank {comm.rank}: no checkpoint of {run.checkpoints} loads on every worker (tried {names}); see the warnings above")
