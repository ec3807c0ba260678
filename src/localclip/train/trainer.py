"""The training loop: one worker's run, the same under every runtime.

:meth:`Trainer.train` owns the loop (epochs, evaluation, when to log and checkpoint, stopping);
:meth:`Trainer.train_step` owns one step (forward, backward, the algorithm's step). What the loop
only calls has its own owner: the algorithm (:func:`localclip.algorithms.build_algorithm`, which
also says how often it communicates), the step decay of lr and γ
(:class:`~localclip.optim.StepDecay`), the NT-ASGD-like average
(:class:`~localclip.train.asgd.EpochAverage`), the mean of the workers' live models that an
evaluation inside an epoch of a streaming run scores (:class:`~localclip.train.live_mean.LiveMean`;
every other evaluation follows a round and scores the model itself), what is recorded per
logging interval and per evaluation (:class:`~localclip.train.metrics.RunMetrics`), what a
checkpoint holds and which one a resume starts from (:mod:`localclip.train.checkpointing`), the
device (:mod:`localclip.devices`) and the run folder (:class:`~localclip.train.run_folder.RunFolder`).
Every worker runs the same code; rank 0 alone writes the run folder.

A stop request (SIGTERM/SIGINT, :mod:`localclip.interrupt`) is acted on at agreement points:
every round boundary (every step for naive parallel clipping), every ``stop_check_interval``
steps within a long period, and every epoch start, where one all-reduce of the request flags
tells every worker whether to checkpoint and stop there.

A run whose validation shows a diverged model (``stop_on_divergence``) ends at that evaluation
with its final one: every worker sees the same all-reduced loss, so they stop together with no
extra collective, and no checkpoint of the diverged state is written (nor, when the run trains
on with ``stop_on_divergence`` off, any checkpoint after a validation that found it diverged).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time

import torch

from localclip import rng
from localclip import devices, interrupt
from localclip.algorithms import build_algorithm
from localclip.algorithms.build import streaming_rounds
from localclip.comm import current
from localclip.errors import ConfigError, Interrupted, NonFiniteError
from localclip.provenance import code_version
from localclip.train.config import TrainConfig
from localclip.optim import StepDecay
from localclip.train.asgd import EpochAverage
from localclip.train.checkpointing import Checkpointer, agree_on_checkpoint, worker_state
from localclip.train.live_mean import LiveMean
from localclip.train.metrics import RunMetrics
from localclip.train.run_folder import RunFolder
from localclip.train.workloads import make_workload

__all__ = ["Trainer", "run_worker", "state_hash"]


def state_hash(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state (names, dtypes, shapes and bytes): equal hashes, equal models."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Trainer:
    """Trains one worker's model with the configured algorithm; see the module docstring."""

    def __init__(self, config: TrainConfig, run_folder: RunFolder | None = None, progress: bool = True):
        self.config = config
        self.comm = current()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        if self.world_size != config.workers:
            raise ConfigError(f"rank {self.rank}: the config asks for {config.workers} workers but the group has {self.world_size}")
        # Every rank writes its own checkpoint file; rank 0 alone writes the shared files.
        self.run_folder = run_folder
        self.run = run_folder if self.rank == 0 else None
        self.device = devices.resolve(config.device)
        self.workload = make_workload(config, self.comm, self.device)
        self.model = self.workload.model
        self.model.train()
        self.algorithm = build_algorithm(config, self.model, self.comm)
        # The worker's own stream for everything random in its steps (dropout masks): seeded
        # from (seed, rank) alone, so no runtime or thread interleaving can change a draw.
        self.generator = rng.worker_generator(config.seed, self.rank, device=self.device)
        rng.set_generator(self.model, self.generator)
        self.progress = progress and self.rank == 0
        self.step = 0
        self.epoch = 0
        self.diverged_at: int | None = None  # the step whose validation found the model diverged
        # Whether the last validation found the model diverged (with stop_on_divergence or
        # without): until the next one finds it finite, no checkpoint is written.
        self._state_diverged = False
        self._bar = None  # the progress bar (rank 0, with progress on)
        # Owners of what the loop only calls: the step decay and the NT-ASGD-like average.
        self.step_size = StepDecay(self.algorithm, config.lr, config.gamma, config.lr_decay_epochs, config.lr_decay)
        self.epoch_average = EpochAverage(self.model, config.asgd_patience)
        # Streaming rounds leave the workers at different models inside an epoch: what an
        # evaluation there scores is their mean, made for it alone.
        self.live_mean = LiveMean(self.model, self.comm)
        self._streaming = self.world_size > 1 and streaming_rounds(config)
        self.metrics = RunMetrics(self.model, self.algorithm, self.comm, self.device, run=self.run, metric=self.workload.metric)
        self.checkpointer = Checkpointer(run_folder, self.comm, interval=config.checkpoint_interval, keep=config.keep_checkpoints)
        self._eval_cache: dict = {}
        self.position, self._num_batches = 0, 1  # batches done in this epoch, of how many
        # Agreement points for a stop request: where the algorithm communicates anyway, and at
        # least every stop_check_interval steps, so that a long period (I = 256 is minutes of
        # local steps for 8 simulated workers on one core) still stops within a sweep's grace time.
        every = self.algorithm.period
        self._agree_every = min(every, config.stop_check_interval) if config.stop_check_interval else every

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint: restored when its epoch's batches have been set up."""
        self.epoch = state["epoch"]
        self.checkpointer.resume(state)

    # -- one step ------------------------------------------------------------------------------

    def _set_step_size(self, scale: float) -> None:
        self.step_size.apply(self.epoch, scale)

    def train_step(self, batch, scale: float = 1.0, sample_mean_gradient: bool = False) -> torch.Tensor:
        """One local step: forward, backward, and the algorithm's step (which may communicate).

        ``sample_mean_gradient``: before the step, all-reduce the workers' gradients to record
        the norm of their mean (every worker must pass the same value)."""
        self._set_step_size(scale)
        if self.device.type != "cpu":
            batch = devices.move(batch, self.device)
        objective, reported = self.workload.loss(batch)
        self.algorithm.zero_grad()
        objective.backward()
        self.metrics.gradients_ready(sample_mean=sample_mean_gradient)
        self.algorithm.step()
        self.metrics.step_taken()
        if self.config.on_nonfinite == "raise" and int(self.algorithm.optimizer.skipped_steps):
            # Opting in to "raise" costs one host read per step (free on the CPU).
            raise NonFiniteError(f"rank {self.rank}: non-finite gradient at step {self.step + 1} (loss {reported.item():.4g})")
        return reported.detach()

    # -- the schedule --------------------------------------------------------------------------

    def _epoch_limit(self, epoch: int, num_batches: int) -> int:
        whole = math.floor(self.config.epochs)
        if epoch < whole:
            return num_batches
        return max(1, round((self.config.epochs - whole) * num_batches))

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.config.epochs)

    def _budget_spent(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def train(self) -> dict | None:
        """Run to the end of the schedule (or ``max_steps``); return the summary on rank 0.

        Raises :class:`~localclip.errors.Interrupted` after checkpointing, on a stop request.
        """
        cfg = self.config
        start = time.perf_counter()
        bar = self._progress_bar()
        for epoch in range(self.epoch, self.num_epochs):
            self.epoch = epoch
            num_batches = self.workload.start_epoch(epoch)
            if bar is not None and bar.total is None:
                bar.total = self._planned_steps(num_batches)  # known once an epoch's batches are
                bar.refresh()
            if self.checkpointer.restore_pending(self) and bar is not None:
                _resume_bar(bar, self.step)
            limit = self._epoch_limit(epoch, num_batches)
            self._num_batches = num_batches
            self.position = self.workload_position()
            if self.position < limit and not self._budget_spent():
                self._run_epoch(limit, bar)
            cut = self._budget_spent() or limit < num_batches
            diverged = self.diverged_at is not None
            if cut and not diverged:
                # The budget ends inside this epoch: keep the state before the final averaging,
                # where a run with a larger budget would carry on; a checkpoint once the final
                # evaluation shows that it did not diverge.
                self.checkpointer.hold(self)
            self.algorithm.average()  # end of the epoch: every worker holds the average
            if self.metrics.interval_open:
                self._log_train(bar)
            if cut or diverged:
                break  # the final evaluation below covers this point
            self._end_of_epoch_eval()
            if self.diverged_at is not None:
                break
            # Checkpoint at the start of the next epoch, its batches set up, so a resume never
            # replays the finished epoch; after the last epoch too, so more epochs can follow.
            self.epoch = epoch + 1
            self._num_batches, self.position = self.workload.start_epoch(self.epoch), 0
            self.save_checkpoint()
            if self.epoch < self.num_epochs:
                self._stop_if_requested()
        if self.checkpointer.pending:
            # Resumed at the very end (the last epoch's closing checkpoint): nothing left to train.
            self._num_batches = self.workload.start_epoch(self.epoch)
            self.checkpointer.restore_pending(self)
        if bar is not None:
            bar.set_postfix_str("final evaluation (valid, test)...", refresh=True)
        final = self._log_eval(splits=("valid", "test"), final=True, shown=bar)
        if self._state_diverged:
            self.checkpointer.drop_held()
        else:
            self.checkpointer.write_held()
        if bar is not None:
            bar.close()
        if self.run is None:
            return None
        summary = {
            "steps": self.step,
            "epochs": self.epoch_progress(),
            "comm/rounds": self.algorithm.rounds,
            "comm/bytes": self.algorithm.bytes_communicated,
            "time/seconds": time.perf_counter() - start,
            "time/compute": self.metrics.time_compute,
            "time/comm": self.metrics.time_comm,
            "algorithm": cfg.algorithm,
            "workers": cfg.workers,
            "period": self.algorithm.period,
            "provenance": code_version(),
        }
        summary.update(final)
        if self.diverged_at is not None:
            summary["diverged_at_step"] = self.diverged_at
        summary["model/sha256"] = state_hash(self.model)
        return summary

    def _run_epoch(self, limit: int, bar) -> None:
        """Steps until the epoch's ``limit`` or the budget: the epoch's last step returns at once
        (its caller checkpoints), before the stream is asked for a batch it would not use."""
        cfg = self.config
        for batch, scale in self.workload.batches():
            self.position += 1
            with self.metrics.timed_step():
                loss = self.train_step(batch, scale, sample_mean_gradient=(self.step + 1) % cfg.log_interval == 0)
            self.step += 1
            self.metrics.count_loss(loss)
            if bar is not None:
                bar.update(1)
            if self.step % cfg.log_interval == 0:
                self._log_train(bar)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0:
                self._log_eval(splits=("valid",), live_mean=self._streaming)
            if self.position >= limit or self._budget_spent() or self.diverged_at is not None:
                return
            if self.checkpointer.due(self.step):
                self.save_checkpoint()
            if self.step % self._agree_every == 0:
                self._stop_if_requested()

    def _stop_if_requested(self) -> None:
        """At an agreement point: if any worker was asked to stop, every worker checkpoints here
        and raises :class:`Interrupted`. One all-reduce (max) of the request flags."""
        flag = torch.tensor([float(interrupt.requested())])
        if self.world_size > 1:
            self.comm.all_reduce([flag], op="max")  # control only: not part of the algorithm's traffic
        signum = int(flag.item())
        if not signum:
            return
        saved = self.save_checkpoint()
        self.comm.barrier()  # rank 0 has moved latest.json before anyone reports the stop
        if self._bar is not None:
            self._bar.close()  # the message that follows gets a line of its own
        name = {int(s): s.name for s in interrupt.SIGNALS}.get(signum, f"signal {signum}")
        kept = "checkpoint saved" if saved else "the model had diverged, so the last checkpoint is the one before that"
        raise Interrupted(
            f"interrupted by {name} at step {self.step} (epoch {self.epoch_progress():.4g}); {kept}, resumable: "
            f"run the same command with --resume"
        )

    def epoch_progress(self) -> float:
        """Epochs done so far, fractional within an epoch."""
        # Counted here, not read from the stream: an image stream moves on to the next epoch as
        # soon as it is exhausted.
        return self.epoch + min(1.0, self.position / max(1, self._num_batches))

    def workload_position(self) -> int:
        stream = self.workload.stream
        return getattr(stream, "batch", getattr(stream, "position", 0))

    def _planned_steps(self, num_batches: int) -> int:
        """Local steps of the whole schedule (every epoch has the same number of batches)."""
        total = sum(self._epoch_limit(e, num_batches) for e in range(self.num_epochs))
        return total if self.config.max_steps is None else min(total, self.config.max_steps)

    def _progress_bar(self):
        if not self.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        total = self.config.max_steps
        self._bar = tqdm(total=total, initial=self.step, desc=f"{self.config.algorithm} N={self.world_size} I={self.config.period}", unit="step", dynamic_ncols=True, leave=False)
        return self._bar

    # -- metrics -------------------------------------------------------------------------------

    def _log_train(self, bar) -> None:
        record = self.metrics.log_interval(self.step, self.epoch_progress())
        if bar is not None and record is not None:
            bar.set_postfix(epoch=f"{record['epoch']:.2f}", loss=f"{record['train/loss']:.3f}", rounds=record["comm/rounds"], refresh=False)

    def _end_of_epoch_eval(self) -> None:
        result = self._log_eval(splits=("valid",))
        if self.config.asgd_patience == 0 or self.workload.metric != "ppl":
            return
        self.epoch_average.end_of_epoch(result["val/ppl"])

    def _evaluate(self, split: str, live_mean: bool = False, shown=None) -> dict:
        """Evaluate once per (step, split, model scored): the final evaluation reuses the
        end-of-epoch one; the mean of the live models at an epoch's last step is not the model
        after that epoch's averaging. ``shown``: a progress bar whose postfix follows this
        worker's part of the evaluation."""
        key = (self.step, self.workload.split_name(split), self.epoch_average.count, live_mean)
        if key not in self._eval_cache:
            progress = _EvalProgress(shown, split) if shown is not None else None
            self._eval_cache = {**{k: v for k, v in self._eval_cache.items() if k[0] == self.step}, key: self.workload.evaluate(split, progress)}
        return self._eval_cache[key]

    def _log_eval(self, splits, final: bool = False, live_mean: bool = False, shown=None) -> dict:
        """Evaluate and log. ``live_mean``: score the mean of the workers' live models
        (:mod:`localclip.train.live_mean`), for an evaluation inside an epoch of a streaming run;
        otherwise the model itself, which every worker holds after a round. ``shown``: a
        progress bar that shows how far each split is."""
        with self.live_mean.swapped_in() if live_mean else contextlib.nullcontext():
            # The evaluated average's weights, before the NT-ASGD average is swapped in.
            moved = self.metrics.movement()
            with self.epoch_average.swapped_in():
                result = {}
                for split in splits:
                    prefix = "val" if split == "valid" else "test"
                    for k, v in self._evaluate(split, live_mean, shown).items():
                        result[f"{prefix}/{k}"] = v
        self.metrics.log_evaluation(self.step, self.epoch_progress(), result, moved, final=final)
        self._state_diverged = _diverged(result)
        if self.config.stop_on_divergence and self.diverged_at is None and self._state_diverged:
            self.diverged_at = self.step
        return result

    # -- checkpoints (what they hold and when they are written: localclip.train.checkpointing) -

    def state_dict(self) -> dict:
        return worker_state(self)

    def save_checkpoint(self) -> bool:
        """Checkpoint here, unless the last validation found the model diverged; whether it did
        (every worker sees the same all-reduced validation, so they agree)."""
        if self._state_diverged:
            return False
        self.checkpointer.save(self)
        return True


class _EvalProgress:
    """Shows on the progress bar how far an evaluation of ``split`` is, in whole percents
    (rank 0's part, which the others' match: the columns are dealt out evenly)."""

    def __init__(self, bar, split: str):
        self.bar, self.split, self.shown = bar, split, -1

    def __call__(self, fraction: float) -> None:
        percent = int(100 * fraction)
        if percent != self.shown:
            self.shown = percent
            self.bar.set_postfix_str(f"final evaluation: {self.split} {percent}%", refresh=True)


def _resume_bar(bar, step: int) -> None:
    """Start the bar at ``step`` as if it had just been created there: the steps a resumed run
    restored were not done now, so they must not count in its rate and ETA."""
    bar.n = bar.last_print_n = bar.initial = step
    bar.start_t = bar.last_print_t = bar._time()
    bar.refresh()


def _diverged(result: dict) -> bool:
    """A validation whose loss is NaN/Inf or whose perplexity overflowed (loss above ~709)."""
    loss, ppl = result.get("val/loss"), result.get("val/ppl")
    return (loss is not None and not math.isfinite(loss)) or (ppl is not None and not math.isfinite(ppl))


def run_worker(config: TrainConfig, run_path: str | None, checkpoints: list[dict] | None, progress: bool = True):
    """Entry point of one worker under any runtime (module-level, so spawn can import it).

    ``checkpoints``: the run folder's kept checkpoint sets, newest first, to resume from the
    newest one that loads on every worker (empty or None: a fresh run).
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    run = RunFolder(run_path, loggers=config.loggers) if run_path is not None else None
    trainer = Trainer(config, run, progress=progress)
    if checkpoints:
        entry, state = agree_on_checkpoint(trainer.comm, run, checkpoints)
        if trainer.rank == 0:
            run.rewind(entry)
        trainer.resume(state)
    summary = trainer.train()
    if trainer.run is not None:
        trainer.run.finish(summary)
    return summary
