"""The training loop: one worker's run, the same under every runtime.

:meth:`Trainer.train` owns the loop (epochs, evaluation, logging, checkpoints, stopping);
:meth:`Trainer.train_step` owns one step (forward, backward, the algorithm's step). What the loop
only calls has its own owner: the algorithm (:func:`localclip.algorithms.build_algorithm`, which
also says how often it communicates), the step decay of lr and γ
(:class:`~localclip.optim.StepDecay`), the NT-ASGD-like average
(:class:`~localclip.train.asgd.EpochAverage`), the device (:mod:`localclip.devices`) and the run
folder (:class:`~localclip.train.run_folder.RunFolder`). Every worker
runs the same code; rank 0 alone writes the run folder. Metrics that need all workers (mean
training loss, clip fraction) are summed with one small all-reduce at log steps, which every
worker reaches at the same step.

Checkpoints make a resumed run bit-identical to an uninterrupted one. Besides every
``checkpoint_interval`` steps, one is written at the start of each epoch and one when the
budget (``max_steps``, ``epochs``) runs out, before the final averaging, so that a larger budget
continues a finished run exactly where a straight run with that budget would be. A stop request
(SIGTERM/SIGINT, :mod:`localclip.interrupt`) is acted on at agreement points: every round
boundary (every step for naive parallel clipping), every ``stop_check_interval`` steps within a
long period, and every epoch start, where one all-reduce
of the request flags tells every worker whether to checkpoint and stop there.

Besides the loss, every logging interval records what explains a run's progress (see
:meth:`Trainer._log_train`): the mean norm of the workers' own gradients, the norm of their mean
(sampled at the interval's last step, with one gradient all-reduce kept out of the algorithm's
traffic and timings), how often a local gradient exceeds the clip norm, and the mean length of a
local step; every evaluation records how far the evaluated (averaged) model moved since the last
one against the mean path the workers walked (``move/efficiency``). None of it changes a number of
the run itself.

A run whose validation shows a diverged model (``stop_on_divergence``) ends at that evaluation
with its final one: every worker sees the same all-reduced loss, so they stop together with no
extra collective, and no checkpoint of the diverged state is written.
"""

from __future__ import annotations

import hashlib
import math
import time

import torch

from localclip import rng
from localclip import devices, interrupt
from localclip.algorithms import build_algorithm
from localclip.comm import current
from localclip.errors import ConfigError, Interrupted, NonFiniteError, RunFolderError
from localclip.provenance import code_version
from localclip.train.config import TrainConfig
from localclip.optim import StepDecay
from localclip.train.asgd import EpochAverage
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
        self._bar = None  # the progress bar (rank 0, with progress on)
        # Owners of what the loop only calls: the step decay and the NT-ASGD-like average.
        self.step_size = StepDecay(self.algorithm, config.lr, config.gamma, config.lr_decay_epochs, config.lr_decay)
        self.epoch_average = EpochAverage(self.model, config.asgd_patience)
        self.time_compute = 0.0
        self.time_comm = 0.0
        # loss sum, steps; the third slot is unused but stays so that checkpoints keep their shape
        self._interval = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._clipped_seen = 0
        # Per interval, summed over this worker's steps: local gradient norm, local step length,
        # steps whose local gradient exceeds the clip norm, the sampled norm of the mean
        # gradient, and the number of such samples.
        self._step_stats = torch.zeros(5, dtype=torch.float64, device=self.device)
        self._probe_cost = (0.0, 0.0, 0.0)  # (clock, comm, waited) seconds of this step's sample
        # The model at the last evaluation (all workers hold the same one there) and the length
        # of the path this worker's local steps walked since.
        self._move_from: torch.Tensor | None = self._flat_params()
        self._path = torch.zeros((), dtype=torch.float64, device=self.device)
        self._resume_state = None
        self._eval_cache: dict = {}
        self._position, self._num_batches = 0, 1
        self._saved_at: tuple | None = None  # (step, epoch, position) of the last checkpoint written or restored
        # Agreement points for a stop request: where the algorithm communicates anyway, and at
        # least every stop_check_interval steps, so that a long period (I = 256 is minutes of
        # local steps for 8 simulated workers on one core) still stops within a sweep's grace time.
        every = self.algorithm.period
        self._agree_every = min(every, config.stop_check_interval) if config.stop_check_interval else every

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint: restored when its epoch's batches have been set up."""
        self.epoch = state["epoch"]
        self._resume_state = state

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
        self._probe_cost = self._sample_mean_gradient() if sample_mean_gradient else (0.0, 0.0, 0.0)
        self.algorithm.step()
        self._record_step()
        if self.config.on_nonfinite == "raise" and int(self.algorithm.optimizer.skipped_steps):
            # Opting in to "raise" costs one host read per step (free on the CPU).
            raise NonFiniteError(f"rank {self.rank}: non-finite gradient at step {self.step + 1} (loss {reported.item():.4g})")
        return reported.detach()

    @torch.no_grad()
    def _sample_mean_gradient(self) -> tuple[float, float, float]:
        """Add the norm of the workers' mean gradient to this interval's samples; return what the
        sample cost (clock, communication and waiting seconds), which no timing counts."""
        t0, comm0, waited0 = self.comm.clock(), self.comm.seconds, self.comm.waited
        grads = [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat(grads)
            if self.world_size > 1:
                self.comm.all_reduce([flat])  # metrics only: not part of the algorithm's traffic
                flat.div_(self.world_size)
            self._step_stats[3] += torch.linalg.vector_norm(flat, dtype=torch.float64)
            self._step_stats[4] += 1
        return self.comm.clock() - t0, self.comm.seconds - comm0, self.comm.waited - waited0

    def _record_step(self) -> None:
        """Accumulate the step's statistics on the device (no host read)."""
        norm = self.algorithm.local_grad_norm.double()
        length = getattr(self.algorithm.optimizer, "last_step_length", None)
        length = length.double() if length is not None else torch.tensor(math.nan, dtype=torch.float64, device=self.device)
        self._step_stats[0] += norm
        self._step_stats[1] += length
        group = self.algorithm.param_groups[0]
        if "gamma" in group:
            self._step_stats[2] += (norm * group["lr"] > group["gamma"]).double()
        self._path += length

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).clone()

    def _movement(self) -> dict:
        """How far the model moved since the last evaluation against the mean path the workers'
        local steps walked (both in parameter space); every worker calls it at every evaluation."""
        path = self._path.reshape(1).clone()
        if self.world_size > 1:
            self.comm.all_reduce([path])  # metrics only
        path = float(path) / self.world_size
        here = self._flat_params()
        moved = {}
        if self._move_from is not None and path > 0:
            displacement = float(torch.linalg.vector_norm(here - self._move_from))
            moved = {"move/path": path, "move/displacement": displacement, "move/efficiency": displacement / path}
        self._move_from = here
        self._path.zero_()
        return moved

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
            if self._resume_state is not None:
                self._restore(self._resume_state)
                self._resume_state = None
                if bar is not None:
                    _resume_bar(bar, self.step)
            limit = self._epoch_limit(epoch, num_batches)
            self._num_batches = num_batches
            self._position = self.workload_position()
            if self._position < limit and not self._budget_spent():
                self._run_epoch(limit, bar)
            cut = self._budget_spent() or limit < num_batches
            diverged = self.diverged_at is not None
            if cut and not diverged:
                # The budget ends inside this epoch: keep the state before the final averaging,
                # where a run with a larger budget would carry on.
                self.save_checkpoint()
            self.algorithm.average()  # end of the epoch: every worker holds the average
            if self._interval[1] > 0:
                self._log_train(bar)
            if cut or diverged:
                break  # the final evaluation below covers this point
            self._end_of_epoch_eval()
            if self.diverged_at is not None:
                break
            # Checkpoint at the start of the next epoch, its batches set up, so a resume never
            # replays the finished epoch; after the last epoch too, so more epochs can follow.
            self.epoch = epoch + 1
            self._num_batches, self._position = self.workload.start_epoch(self.epoch), 0
            self.save_checkpoint()
            if self.epoch < self.num_epochs:
                self._stop_if_requested()
        if self._resume_state is not None:
            # Resumed at the very end (the last epoch's closing checkpoint): nothing left to train.
            self._num_batches = self.workload.start_epoch(self.epoch)
            self._restore(self._resume_state)
            self._resume_state = None
        if bar is not None:
            bar.set_postfix_str("final evaluation (valid, test)...", refresh=True)
        final = self._log_eval(splits=("valid", "test"), final=True)
        if bar is not None:
            bar.close()
        if self.run is None:
            return None
        summary = {
            "steps": self.step,
            "epochs": self._epoch_progress(),
            "comm/rounds": self.algorithm.rounds,
            "comm/bytes": self.algorithm.bytes_communicated,
            "time/seconds": time.perf_counter() - start,
            "time/compute": self.time_compute,
            "time/comm": self.time_comm,
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
            self._position += 1
            comm_before, waited_before = self.comm.seconds, self.comm.waited
            t0 = self.comm.clock()
            loss = self.train_step(batch, scale, sample_mean_gradient=(self.step + 1) % cfg.log_interval == 0)
            # A simulated worker's wait for the others' turns is neither its compute nor
            # communication: leave it out of both; so is the statistics' gradient sample.
            probe_clock, probe_comm, probe_waited = self._probe_cost
            dt = self.comm.clock() - t0 - probe_clock
            comm_dt = self.comm.seconds - comm_before - probe_comm
            self.time_comm += comm_dt
            self.time_compute += dt - comm_dt - (self.comm.waited - waited_before - probe_waited)
            self.step += 1
            self._interval[0] += loss.double()
            self._interval[1] += 1
            if bar is not None:
                bar.update(1)
            if self.step % cfg.log_interval == 0:
                self._log_train(bar)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0:
                self._log_eval(splits=("valid",))
            if self._position >= limit or self._budget_spent() or self.diverged_at is not None:
                return
            if self.step % cfg.checkpoint_interval == 0:
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
        self.save_checkpoint()
        self.comm.barrier()  # rank 0 has moved latest.json before anyone reports the stop
        if self._bar is not None:
            self._bar.close()  # the message that follows gets a line of its own
        name = {int(s): s.name for s in interrupt.SIGNALS}.get(signum, f"signal {signum}")
        raise Interrupted(
            f"interrupted by {name} at step {self.step} (epoch {self._epoch_progress():.4g}); checkpoint saved, resumable: "
            f"run the same command with --resume"
        )

    def _epoch_progress(self) -> float:
        """Epochs done so far, fractional within an epoch."""
        # Counted here, not read from the stream: an image stream moves on to the next epoch as
        # soon as it is exhausted.
        return self.epoch + min(1.0, self._position / max(1, self._num_batches))

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
        opt = self.algorithm.optimizer
        clipped = int(opt.clipped_steps)
        extra = [clipped - self._clipped_seen, self.time_compute, self.time_comm, int(opt.skipped_steps), self.algorithm.averager.nonfinite_rounds]
        stats = torch.cat([self._interval.cpu(), torch.tensor(extra, dtype=torch.float64), self._step_stats.cpu()])
        self._clipped_seen = clipped
        self.comm.all_reduce([stats])  # metrics only: not part of the algorithm's traffic
        loss_sum, steps, _, clipped_sum, t_compute, t_comm, skipped, nonfinite_rounds, *step_stats = stats.tolist()
        norm_sum, length_sum, local_hits, mean_norm_sum, samples = step_stats
        self._interval.zero_()
        self._step_stats.zero_()
        if self.run is None or steps == 0:
            return
        group = self.algorithm.param_groups[0]
        record = {
            "step": self.step,
            "epoch": self._epoch_progress(),
            "train/loss": loss_sum / steps,
            "train/ppl": (math.exp(loss_sum / steps) if loss_sum / steps < 709 else math.inf) if self.workload.metric == "ppl" else None,
            "clip/fraction": clipped_sum / steps,
            # The mechanism: local gradients against their mean, and the local step length.
            "clip/local_fraction": local_hits / steps if "gamma" in self.algorithm.param_groups[0] else None,
            "grad/local_norm": norm_sum / steps,
            "grad/mean_norm": mean_norm_sum / samples if samples else None,
            "step/length": length_sum / steps,
            "comm/rounds": self.algorithm.rounds,
            "comm/bytes": self.algorithm.bytes_communicated,
            "time/compute": t_compute / self.world_size,
            "time/comm": t_comm / self.world_size,
            "lr": group["lr"],
            "gamma": group.get("gamma"),
            "train/skipped_steps": int(skipped),
            "comm/nonfinite_rounds": int(nonfinite_rounds),
        }
        self.run.log({k: v for k, v in record.items() if v is not None})
        if bar is not None:
            bar.set_postfix(epoch=f"{self._epoch_progress():.2f}", loss=f"{loss_sum / steps:.3f}", rounds=self.algorithm.rounds, refresh=False)

    def _end_of_epoch_eval(self) -> None:
        result = self._log_eval(splits=("valid",))
        if self.config.asgd_patience == 0 or self.workload.metric != "ppl":
            return
        self.epoch_average.end_of_epoch(result["val/ppl"])

    def _evaluate(self, split: str) -> dict:
        """Evaluate once per (step, split): the final evaluation reuses the end-of-epoch one."""
        key = (self.step, self.workload.split_name(split), self.epoch_average.count)
        if key not in self._eval_cache:
            self._eval_cache = {**{k: v for k, v in self._eval_cache.items() if k[0] == self.step}, key: self.workload.evaluate(split)}
        return self._eval_cache[key]

    def _log_eval(self, splits, final: bool = False) -> dict:
        moved = self._movement()
        with self.epoch_average.swapped_in():
            result = {}
            for split in splits:
                prefix = "val" if split == "valid" else "test"
                for k, v in self._evaluate(split).items():
                    result[f"{prefix}/{k}"] = v
        if self.run is not None:
            record = {"step": self.step, "epoch": self._epoch_progress(), **result, **moved, "comm/rounds": self.algorithm.rounds, "comm/bytes": self.algorithm.bytes_communicated}
            if final:
                record["final"] = True
            self.run.log(record)
        if self.config.stop_on_divergence and self.diverged_at is None and _diverged(result):
            self.diverged_at = self.step
        return result

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "algorithm": self.algorithm.state_dict(),
            "workload": self.workload.state_dict(),
            "rng": self.generator.get_state(),
            **self.epoch_average.state_dict(),
            "time_compute": self.time_compute,
            "time_comm": self.time_comm,
            "interval": self._interval.clone(),
            "clipped_seen": self._clipped_seen,
            "step_stats": self._step_stats.clone(),
            "move_from": self._move_from,
            "path": self._path.clone(),
        }

    def save_checkpoint(self) -> None:
        if self.run_folder is None:
            return
        here = (self.step, self.epoch, self._position)
        if here == self._saved_at:
            return  # this very state is already on disk (just written, or resumed from)
        # The start of an epoch gets its own name: the last step of the previous epoch may
        # have a checkpoint of its own, a different state at the same step.
        name = f"step-{self.step}-epoch-{self.epoch}" if self._position == 0 and self.epoch > 0 else f"step-{self.step}"
        self.run_folder.save_worker_checkpoint(devices.to_cpu(self.state_dict()), name, self.rank)
        self.comm.barrier()  # every rank's file exists before latest.json moves
        if self.rank == 0:
            self.run_folder.commit_checkpoint(
                self.step, self.world_size, name=name, epochs=self._epoch_progress(), keep=self.config.keep_checkpoints
            )
        self._saved_at = here

    def _restore(self, state: dict) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.workload.load_state_dict(state["workload"])
        self.step = state["step"]
        self.epoch_average.load_state_dict(state, self.device)
        self.time_compute, self.time_comm = state["time_compute"], state["time_comm"]
        self._interval.copy_(state["interval"])
        self._clipped_seen = state["clipped_seen"]
        # Checkpoints written before these statistics existed: count them from here.
        self._step_stats.copy_(state.get("step_stats", torch.zeros_like(self._step_stats)))
        self._move_from = devices.move(state.get("move_from"), self.device)
        self._path.copy_(state.get("path", torch.zeros_like(self._path)))
        self.generator.set_state(state["rng"])
        self._position = self.workload_position()
        self._saved_at = (self.step, self.epoch, self._position)


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
        entry, state = _agree_on_checkpoint(trainer, run, checkpoints)
        if trainer.rank == 0:
            run.rewind(entry)
        trainer.resume(state)
    summary = trainer.train()
    if trainer.run is not None:
        trainer.run.finish(summary)
    return summary


def _agree_on_checkpoint(trainer: Trainer, run: RunFolder, checkpoints: list[dict]) -> tuple[dict, dict]:
    """Load this worker's file of each kept set; one all-reduce tells everyone which sets failed
    anywhere; every worker takes the newest set that loaded everywhere."""
    import sys

    states, failures = [], []
    for entry in checkpoints:
        try:
            states.append(run.load_worker_checkpoint(entry["dir"], trainer.rank))
            failures.append(0.0)
        except RunFolderError as exc:
            states.append(None)
            failures.append(1.0)
            print(f"localclip: warning: {exc}", file=sys.stderr, flush=True)
    flags = torch.tensor(failures)
    trainer.comm.all_reduce([flags], op="max")
    for entry, state, failed in zip(checkpoints, states, flags.tolist()):
        if not failed:
            if entry is not checkpoints[0] and trainer.rank == 0:
                print(f"localclip: warning: resuming from the older checkpoint {entry['dir']}: a newer one does not load on every worker",
                      file=sys.stderr, flush=True)
            return entry, state
    names = ", ".join(e["dir"] for e in checkpoints)
    raise RunFolderError(f"rank {trainer.rank}: no checkpoint of {run.checkpoints} loads on every worker (tried {names}); see the warnings above")
