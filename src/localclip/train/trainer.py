"""The training loop: one worker's run, the same under every runtime.

:meth:`Trainer.train` owns the loop (epochs, evaluation, when to log and checkpoint, stopping);
:meth:`Trainer.train_step` owns one step (forward, backward, the algorithm's step). What the loop
only calls has its own owner: the algorithm (:func:`localclip.algorithms.build_algorithm`), the
step decay of lr and γ
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
from localclip.algorithms.build import outer_optimizer, streaming_rounds
from localclip.comm import current
from localclip.errors import CommunicationError, ConfigError, Interrupted, NonFiniteError
from localclip.provenance import code_version
from localclip.train.config import TrainConfig
from localclip.optim import StepDecay
from localclip.train.asgd import EpochAverage
from localclip.train.checkpointing import Checkpointer, agree_on_checkpoint, worker_state
from localclip.train.live_mean import LiveMean
from localclip.train.metrics import RunMetrics
from localclip.train.roster import Roster
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
    """Trains one worker's model with the configured algorithm; see the module docstring.

    ``config`` is resolved (:func:`localclip.algorithms.build.resolved`): the trainer reads its
    values, the period among them, from the config and never back from what was built from it.
    """

    def __init__(self, config: TrainConfig, run_folder: RunFolder | None = None, progress: bool = True):
        self.config = config
        self.comm = current()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # Who shares this worker's records, evaluations, checkpoints and stop requests: the
        # group, or under a fault-tolerant runtime (localclip.comm.ft) the worker alone, a run
        # of its own between rounds whose membership changes.
        self.control = getattr(self.comm, "control", self.comm)
        # With idle non-participants the group is the K slots that play the sampled workers.
        self.roster = Roster(config.algorithm.workers, config.round.participants, config.run.seed) if config.round.non_participants == "idle" else None
        group = config.algorithm.workers if self.roster is None else self.roster.slots
        if self.world_size != group:
            raise ConfigError(f"rank {self.rank}: the config asks for {group} workers but the group has {self.world_size}")
        # Every rank writes its own checkpoint file; rank 0 alone writes the shared files.
        self.run_folder = run_folder
        self.run = run_folder if self.control.rank == 0 else None
        self.device = devices.resolve(config.run.device)
        self.workload = make_workload(config, self.comm, self.device)
        if self.roster is not None:
            self.workload.workers = config.algorithm.workers
        self.workload.eval_comm = self.control
        self.model = self.workload.model
        self.model.train()
        # The round's outer optimizer is built from the config here and handed down both to the
        # algorithm and, with outer_lr_decay, to the step decay (never read back from the algorithm).
        outer = outer_optimizer(config)
        self.algorithm = build_algorithm(config, self.model, self.comm, outer=outer)
        # The worker's own stream for everything random in its steps (dropout masks): seeded
        # from (seed, rank) alone, so no runtime or thread interleaving can change a draw.
        self.generator = rng.worker_generator(config.run.seed, self.rank, device=self.device)
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
        self.step_size = StepDecay(self.algorithm, config.local.lr, config.local.gamma, config.schedule.lr_decay_epochs, config.schedule.lr_decay,
                                   outer=outer if config.round.outer_lr_decay else None)
        self.epoch_average = EpochAverage(self.model, config.evaluation.asgd_patience)
        # Streaming rounds leave the workers at different models inside an epoch: what an
        # evaluation there scores is their mean, made for it alone.
        self.live_mean = LiveMean(self.model, self.comm)
        self._streaming = self.world_size > 1 and streaming_rounds(config)
        # A failure plan (simulator): who is away at each step and in each round, and the heals.
        self.membership = self._failure_plan() if config.algorithm.fail else None
        self._healed: dict | None = None  # a fault-tolerant joiner's counters, restored at its epoch's start
        self._joining = False
        self._in_step = False  # inside train_step (a round there belongs to the step not yet counted)
        if getattr(self.comm, "membership", None) is not None:
            self.membership = self.comm.membership
            self.membership.attach(self._heal_state, self._heal_from_peer)
            self.algorithm.averager.use_membership(self.membership)
        self.metrics = RunMetrics(self.model, self.algorithm, self.control, self.device, run=self.run, metric=self.workload.metric)
        self.checkpointer = Checkpointer(run_folder, self.control, interval=config.run.checkpoint_interval, keep=config.run.keep_checkpoints)
        self._eval_cache: dict = {}
        self.position, self._num_batches = 0, 1  # batches done in this epoch, of how many
        # Agreement points for a stop request: where the algorithm communicates anyway, and at
        # least every stop_check_interval steps, so that a long period (I = 256 is minutes of
        # local steps for 8 simulated workers on one core) still stops within a sweep's grace time.
        # The period is the resolved config's (naive's and single's are 1 there), as the builder
        # handed it to the algorithm.
        every = config.round.period
        self._agree_every = min(every, config.run.stop_check_interval) if config.run.stop_check_interval else every

    def _failure_plan(self):
        """The config's failure plan over this simulated worker (:mod:`localclip.comm.membership`)."""
        from localclip.comm.membership import PlannedMembership, parse_plan

        if not hasattr(self.comm, "world"):
            raise ConfigError(f"rank {self.rank}: fail={self.config.algorithm.fail} is a plan for the simulator: run it with --runtime simulate")
        membership = PlannedMembership(parse_plan(self.config.algorithm.fail), self.comm, self.config.round.period)
        membership.attach(self._heal_state, self._heal_planned)
        self.algorithm.averager.use_membership(membership)
        return membership

    def _heal_state(self) -> dict:
        """What a joiner copies from a live peer: the model and the algorithm's state (the
        optimizer's, the averager's: anchor, outer optimizer, counters), and where the peer is:
        its epoch, its place in the epoch's batches and its local steps done as of the round,
        the step whose round this is included (a round runs inside that step, which
        :meth:`_run_epoch` counts once it returns)."""
        return {"model": self.model.state_dict(), "algorithm": self.algorithm.state_dict(), "step": self.step + self._in_step,
                "epoch": self.epoch, "workload": self.workload.state_dict()}

    def _heal(self, state: dict) -> None:
        """Take a live peer's state (copies: the peer's tensors stay its own). The dropout stream
        is this worker's own, reseeded from where it joins: a copy of the peer's would draw the
        peer's masks."""
        import copy

        state = copy.deepcopy(state)
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
        step = self.algorithm.averager.step_count
        self.generator.manual_seed(rng.derive_seed(self.config.run.seed, self.rank, "rejoin", step))

    def _heal_planned(self, state: dict) -> None:
        """A simulated joiner (a failure plan) takes its peer's state; it has gone through the
        batches it skipped, so its stream is at its peer's place already: it goes on from there
        with a zero recurrent state (:meth:`LMWorkload.rejoin`), as a restarted process does."""
        self._heal(state)
        self.workload.rejoin()

    def _heal_from_peer(self, state: dict) -> None:
        """A fault-tolerant joiner takes its peer's state: the model and the algorithm's now (the
        round that heals it then writes the average), the step, epoch and data position at the
        start of that epoch's batches (:meth:`train`)."""
        self._heal(state)
        self.checkpointer.discard_pending()
        if self._joining:  # the join round, before the first epoch's batches are set up
            self.epoch = state["epoch"]
            self._healed = {"step": state["step"], "workload": state["workload"]}
            return
        # Mid-run (a worker that was frozen and fell behind): its stream moves to the peer's place.
        if state["epoch"] != self.epoch:
            raise CommunicationError(f"rank {self.rank}: healed from a peer in epoch {state['epoch']} while in epoch {self.epoch}: "
                                     f"restart this worker with --resume")
        self.workload.rejoin(state["workload"])
        # Inside a step of its own, the joiner counts that step when it returns.
        self.step, self.position = state["step"] - self._in_step, self.workload_position()

    def _restore_healed(self) -> None:
        if self._healed is not None:
            self.workload.rejoin(self._healed["workload"])
            self.step = self._healed["step"]
            self._healed = None

    def _away(self) -> bool:
        """Whether this worker is away for its next step (a failure plan)."""
        return self.membership is not None and not self.membership.computes(self.step + 1, self.algorithm.averager.schedule.last_round_step)

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint: restored when its epoch's batches have been set up."""
        self.epoch = state["epoch"]
        self.checkpointer.resume(state)

    # -- one step ------------------------------------------------------------------------------

    def _set_step_size(self, scale: float) -> None:
        self.step_size.apply(self.epoch, scale)

    def train_step(self, batch, scale: float = 1.0, sample_mean_gradient: bool = False) -> torch.Tensor:
        """One local step: forward, backward, and the algorithm's step (which may communicate).

        ``sample_mean_gradient``: sample this step's statistics: before the step, all-reduce the
        workers' gradients to record the norm of their mean; after it, record the length of the
        local step (every worker must pass the same value)."""
        self._set_step_size(scale)
        if self._away():
            return self._skip_step(sample_mean_gradient)
        if self.device.type != "cpu":
            batch = devices.move(batch, self.device)
        objective, reported = self.workload.loss(batch)
        self.algorithm.zero_grad()
        objective.backward()
        self.metrics.gradients_ready(sample_mean=sample_mean_gradient)
        self.algorithm.step()
        self.metrics.step_taken()
        if self.config.run.on_nonfinite == "raise" and int(self.algorithm.optimizer.skipped_steps):
            # Opting in to "raise" costs one host read per step (free on the CPU).
            raise NonFiniteError(f"rank {self.rank}: non-finite gradient at step {self.step + 1} (loss {reported.item():.4g})")
        return reported.detach()

    def _skip_step(self, sample_mean_gradient: bool) -> None:
        """A step of a worker that is away: its batch is skipped, the schedule moves on (its
        rounds run with this worker out of them). The mean-gradient probe, a collective of every
        worker, counts its gradient as zero."""
        if sample_mean_gradient:
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        self.metrics.gradients_ready(sample_mean=sample_mean_gradient)
        self.algorithm.skip_step()
        return None

    # -- the schedule --------------------------------------------------------------------------

    def _epoch_limit(self, epoch: int, num_batches: int) -> int:
        whole = math.floor(self.config.schedule.epochs)
        if epoch < whole:
            return num_batches
        return max(1, round((self.config.schedule.epochs - whole) * num_batches))

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.config.schedule.epochs)

    def _budget_spent(self) -> bool:
        return self.config.schedule.max_steps is not None and self.step >= self.config.schedule.max_steps

    def train(self) -> dict | None:
        """Run to the end of the schedule (or ``max_steps``); return the summary on rank 0.

        Raises :class:`~localclip.errors.Interrupted` after checkpointing, on a stop request.
        """
        cfg = self.config
        start = time.perf_counter()
        if getattr(self.comm, "membership", None) is not None:
            # A late or restarted worker heals here from a live peer, whose state supersedes a
            # checkpoint it resumed from; without a live peer the checkpoint stands.
            self._joining = True
            try:
                self.membership.join(self.algorithm.averager)
            finally:
                self._joining = False
        bar = self._progress_bar()
        for epoch in range(self.epoch, self.num_epochs):
            self.epoch = epoch
            num_batches = self.workload.start_epoch(epoch)
            if bar is not None and bar.total is None:
                bar.total = self._planned_steps(num_batches)  # known once an epoch's batches are
                bar.refresh()
            restored = self.checkpointer.restore_pending(self)
            if restored and bar is not None:
                _resume_bar(bar, self.step)
            self._play(fresh=not restored)
            self._restore_healed()
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
            rounds = self._rounds()
            self.algorithm.average()  # end of the epoch: every worker holds the average
            if self._rounds() != rounds:
                self._play()
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
            "algorithm": cfg.algorithm.name,
            "workers": cfg.algorithm.workers,
            "period": cfg.round.period,
            "provenance": code_version(),
        }
        summary.update(final)
        if self.diverged_at is not None:
            summary["diverged_at_step"] = self.diverged_at
        if self.membership is not None:
            summary["comm/discarded_rounds"] = self.algorithm.averager.discarded_rounds
        summary["model/sha256"] = state_hash(self.model)
        return summary

    def _run_epoch(self, limit: int, bar) -> None:
        """Steps until the epoch's ``limit`` or the budget: the epoch's last step returns at once
        (its caller checkpoints), before the stream is asked for a batch it would not use."""
        cfg = self.config
        for batch, scale in self.workload.batches():
            self.position += 1
            rounds = self._rounds()
            with self.metrics.timed_step():
                # Sampled: the last step of each logging interval and of each epoch (whose last
                # interval is logged early); not where a budget cuts the run, which a run with a
                # larger budget passes without a sample.
                last = (self.step + 1) % cfg.run.log_interval == 0 or self.position >= self._num_batches
                self._in_step = True
                try:
                    loss = self.train_step(batch, scale, sample_mean_gradient=last)
                finally:
                    self._in_step = False
            self.step += 1
            if self._rounds() != rounds:
                self._play()
            if loss is not None:
                self.metrics.count_loss(loss)
            if bar is not None:
                bar.update(1)
            if self.step % cfg.run.log_interval == 0:
                self._log_train(bar)
            if cfg.evaluation.eval_interval and self.step % cfg.evaluation.eval_interval == 0:
                self._log_eval(splits=("valid",), live_mean=self._streaming)
            if self.position >= limit or self._budget_spent() or self.diverged_at is not None:
                return
            if self.checkpointer.due(self.step):
                self.save_checkpoint()
            if self.step % self._agree_every == 0:
                self._stop_if_requested()

    def _rounds(self) -> int:
        """Model-averaging rounds so far (what partial participation's draws are indexed by)."""
        averager = getattr(self.algorithm, "averager", None)
        return averager.rounds if averager is not None else 0

    def _play(self, fresh: bool = True) -> None:
        """With idle non-participants: take on the worker this slot plays until the next round
        (:mod:`localclip.train.roster`); ``fresh=False`` right after a resume, whose checkpoint
        holds that worker's recurrent state and dropout stream already."""
        if self.roster is None:
            return
        index = self._rounds()
        worker = self.roster.worker(index, self.rank)
        self.workload.play(worker, fresh=fresh)
        if fresh:
            self.generator.manual_seed(self.roster.dropout_seed(worker, index))

    def _stop_if_requested(self) -> None:
        """At an agreement point: if any worker was asked to stop, every worker checkpoints here
        and raises :class:`Interrupted`. One all-reduce (max) of the request flags."""
        flag = torch.tensor([float(interrupt.requested())])
        if self.control.world_size > 1:
            self.control.all_reduce([flag], op="max")  # control only: not part of the algorithm's traffic
        signum = int(flag.item())
        if not signum:
            return
        saved = self.save_checkpoint()
        self.control.barrier()  # rank 0 has moved latest.json before anyone reports the stop
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
        return total if self.config.schedule.max_steps is None else min(total, self.config.schedule.max_steps)

    def _progress_bar(self):
        if not self.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        total = self.config.schedule.max_steps
        self._bar = tqdm(total=total, initial=self.step, desc=f"{self.config.algorithm.name} N={self.config.algorithm.workers}{self._participants_label()} I={self.config.round.period}", unit="step", dynamic_ncols=True, leave=False)
        return self._bar

    def _participants_label(self) -> str:
        k = self.config.round.participants
        return "" if k is None or k >= self.config.algorithm.workers else f" K={k}"

    # -- metrics -------------------------------------------------------------------------------

    def _log_train(self, bar) -> None:
        record = self.metrics.log_interval(self.step, self.epoch_progress())
        if bar is not None and record is not None:
            bar.set_postfix(epoch=f"{record['epoch']:.2f}", loss=f"{record['train/loss']:.3f}", rounds=record["comm/rounds"], refresh=False)

    def _end_of_epoch_eval(self) -> None:
        result = self._log_eval(splits=("valid",))
        if self.config.evaluation.asgd_patience == 0 or self.workload.metric != "ppl":
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
        if self.config.evaluation.stop_on_divergence and self.diverged_at is None and self._state_diverged:
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
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    run = RunFolder(run_path, loggers=config.run.loggers) if run_path is not None else None
    trainer = Trainer(config, run, progress=progress)
    if checkpoints:
        entry, state = agree_on_checkpoint(trainer.control, run, checkpoints)
        if trainer.control.rank == 0:
            run.rewind(entry)
        trainer.resume(state)
    summary = trainer.train()
    if trainer.run is not None:
        trainer.run.finish(summary)
    return summary
