"""What a run records about itself: the record of every logging interval and of every evaluation.

Per logging interval (:meth:`RunMetrics.log_interval`), besides the loss: what explains a run's
progress, namely the mean norm of the workers' own gradients, how often the algorithm clipped and
how often a local gradient exceeds the clip norm (every step), the norm of the workers' mean
gradient and the length of a local step (sampled at the interval's last step: the first costs one
gradient all-reduce kept out of the algorithm's traffic and timings, the second extra passes over
the gradients and parameters that the optimizer makes only when asked, see
:attr:`~localclip.optim.ClippedSGD.measure_step_length`), the rounds and bytes so far, the compute
and communication seconds, lr and γ. Per evaluation (:meth:`RunMetrics.log_evaluation`): the
scores, and how far the evaluated (averaged) model moved since the last evaluation against the
mean path the workers' local steps walked (``move/efficiency``; each sampled step length counts
for every step of its interval, so an evaluation inside an interval leaves that interval's steps
to the next evaluation's path).

The statistics accumulate on the device with no host read; at a log step one small all-reduce
sums them over the workers, which every worker reaches at the same step. Rank 0 alone writes
the records. None of it changes a number of the run itself.
"""

from __future__ import annotations

import contextlib
import math

import torch

from localclip import devices

__all__ = ["RunMetrics"]


class RunMetrics:
    """One worker's running statistics and timings, and the records made of them.

    ``run``: the run folder the records go to (rank 0's; None on the other ranks, which still
    take part in every all-reduce). ``metric``: the workload's score (``"ppl"`` adds
    ``train/ppl``)."""

    def __init__(self, model: torch.nn.Module, algorithm, comm, device: torch.device, run=None, metric: str | None = None):
        self.model, self.algorithm, self.comm, self.device = model, algorithm, comm, device
        self.run, self.metric = run, metric
        self.world_size = comm.world_size
        self.time_compute = 0.0
        self.time_comm = 0.0
        # loss sum, steps; the third slot is unused but stays so that checkpoints keep their shape
        self.interval = torch.zeros(3, dtype=torch.float64, device=device)
        self.clipped_seen = 0
        # Per interval, summed over this worker's steps: local gradient norm, the sampled local
        # step length, steps whose local gradient exceeds the clip norm, the sampled norm of the
        # mean gradient, and the number of sampled steps.
        self.step_stats = torch.zeros(5, dtype=torch.float64, device=device)
        self.sampled = False  # whether the step in progress is sampled
        self.probe_cost = (0.0, 0.0, 0.0)  # (clock, comm, waited) seconds of this step's sample
        # The model at the last evaluation (all workers hold the same one there) and the length
        # of the path this worker's local steps walked since.
        self.move_from: torch.Tensor | None = self._flat_params()
        self.path = torch.zeros((), dtype=torch.float64, device=device)

    # -- one step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def timed_step(self):
        """Around one training step: add its compute and communication seconds to the totals.

        A simulated worker's wait for the others' turns is neither its compute nor communication:
        it is left out of both; so is the cost of the step's mean-gradient sample."""
        comm_before, waited_before = self.comm.seconds, self.comm.waited
        t0 = self.comm.clock()
        yield
        probe_clock, probe_comm, probe_waited = self.probe_cost
        dt = self.comm.clock() - t0 - probe_clock
        comm_dt = self.comm.seconds - comm_before - probe_comm
        self.time_comm += comm_dt
        self.time_compute += dt - comm_dt - (self.comm.waited - waited_before - probe_waited)

    def gradients_ready(self, sample_mean: bool) -> None:
        """After the backward pass, before the algorithm's step: with ``sample_mean``, sample this
        step: add the norm of the workers' mean gradient to this interval's samples, and have the
        optimizer measure the length of its step (every worker must pass the same value)."""
        self.sampled = sample_mean
        if hasattr(self.algorithm.optimizer, "measure_step_length"):
            self.algorithm.optimizer.measure_step_length = sample_mean
        self.probe_cost = self._sample_mean_gradient() if sample_mean else (0.0, 0.0, 0.0)

    @torch.no_grad()
    def _sample_mean_gradient(self) -> tuple[float, float, float]:
        """Sample the norm of the workers' mean gradient; return what the sample cost (clock,
        communication and waiting seconds), which no timing counts."""
        t0, comm0, waited0 = self.comm.clock(), self.comm.seconds, self.comm.waited
        grads = [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat(grads)
            if self.world_size > 1:
                self.comm.all_reduce([flat])  # metrics only: not part of the algorithm's traffic
                flat.div_(self.world_size)
            self.step_stats[3] += torch.linalg.vector_norm(flat, dtype=torch.float64)
            self.step_stats[4] += 1
        return self.comm.clock() - t0, self.comm.seconds - comm0, self.comm.waited - waited0

    def step_taken(self) -> None:
        """After the algorithm's step: accumulate its statistics on the device (no host read)."""
        norm = self.algorithm.local_grad_norm.double()
        self.step_stats[0] += norm
        group = self.algorithm.param_groups[0]
        if "gamma" in group:
            self.step_stats[2] += (norm * group["lr"] > group["gamma"]).double()
        if self.sampled:
            length = getattr(self.algorithm.optimizer, "last_step_length", None)
            length = length.double() if length is not None else torch.tensor(math.nan, dtype=torch.float64, device=self.device)
            self.step_stats[1] += length
            # The sampled length counts for every step of the interval so far, this one included.
            self.path += length * (self.interval[1] + 1)

    def count_loss(self, loss: torch.Tensor) -> None:
        """Add a finished step's training loss to the interval."""
        self.interval[0] += loss.double()
        self.interval[1] += 1

    @property
    def interval_open(self) -> bool:
        """Whether the interval holds steps not yet logged (one host read)."""
        return bool(self.interval[1] > 0)

    # -- records -------------------------------------------------------------------------------

    def log_interval(self, step: int, epoch: float) -> dict | None:
        """Close the interval: sum its statistics over the workers (every worker calls this at the
        same step) and log the record; return it where one was written (rank 0)."""
        opt = self.algorithm.optimizer
        clipped = int(opt.clipped_steps)
        extra = [clipped - self.clipped_seen, self.time_compute, self.time_comm, int(opt.skipped_steps), self.algorithm.averager.nonfinite_rounds]
        stats = torch.cat([self.interval.cpu(), torch.tensor(extra, dtype=torch.float64), self.step_stats.cpu()])
        self.clipped_seen = clipped
        self.comm.all_reduce([stats])  # metrics only: not part of the algorithm's traffic
        loss_sum, steps, _, clipped_sum, t_compute, t_comm, skipped, nonfinite_rounds, *step_stats = stats.tolist()
        norm_sum, length_sum, local_hits, mean_norm_sum, samples = step_stats
        self.interval.zero_()
        self.step_stats.zero_()
        # Under a changing group: each round's (step, quorum, models averaged) since the last record.
        quorums = self.algorithm.averager.take_quorums() if getattr(self.algorithm.averager, "membership", None) is not None else None
        if self.run is None or steps == 0:
            return None
        group = self.algorithm.param_groups[0]
        record = {
            "step": step,
            "epoch": epoch,
            "train/loss": loss_sum / steps,
            "train/ppl": (math.exp(loss_sum / steps) if loss_sum / steps < 709 else math.inf) if self.metric == "ppl" else None,
            "clip/fraction": clipped_sum / steps,
            # The mechanism: local gradients against their mean, and the local step length.
            "clip/local_fraction": local_hits / steps if "gamma" in group else None,
            "grad/local_norm": norm_sum / steps,
            "grad/mean_norm": mean_norm_sum / samples if samples else None,
            "step/length": length_sum / samples if samples else None,
            "comm/rounds": self.algorithm.rounds,
            "comm/bytes": self.algorithm.bytes_communicated,
            "time/compute": t_compute / self.world_size,
            "time/comm": t_comm / self.world_size,
            "lr": group["lr"],
            "gamma": group.get("gamma"),
            "train/skipped_steps": int(skipped),
            "comm/nonfinite_rounds": int(nonfinite_rounds),
        }
        if quorums is not None:
            record["comm/quorums"] = [list(q) for q in quorums]
        record = {k: v for k, v in record.items() if v is not None}
        self.run.log(record)
        return record

    def movement(self) -> dict:
        """How far the model moved since the last evaluation against the mean path the workers'
        local steps walked (both in parameter space); every worker calls it at every evaluation,
        with the evaluated model in place (the model itself, or inside an epoch of a streaming
        run the mean of the workers' live models), not the NT-ASGD average."""
        path = self.path.reshape(1).clone()
        if self.world_size > 1:
            self.comm.all_reduce([path])  # metrics only
        path = float(path) / self.world_size
        here = self._flat_params()
        moved = {}
        if self.move_from is not None and path > 0:
            displacement = float(torch.linalg.vector_norm(here - self.move_from))
            moved = {"move/path": path, "move/displacement": displacement, "move/efficiency": displacement / path}
        self.move_from = here
        self.path.zero_()
        return moved

    def log_evaluation(self, step: int, epoch: float, result: dict, moved: dict, final: bool = False) -> None:
        """Log an evaluation's scores (``result``) and the :meth:`movement` that led to it."""
        if self.run is None:
            return
        record = {"step": step, "epoch": epoch, **result, **moved, "comm/rounds": self.algorithm.rounds, "comm/bytes": self.algorithm.bytes_communicated}
        if final:
            record["final"] = True
        self.run.log(record)

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).clone()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Keys of the worker's checkpoint itself (one flat dict with the other owners' keys),
        # so that checkpoints of earlier versions load.
        return {
            "time_compute": self.time_compute,
            "time_comm": self.time_comm,
            "interval": self.interval.clone(),
            "clipped_seen": self.clipped_seen,
            "step_stats": self.step_stats.clone(),
            "move_from": self.move_from,
            "path": self.path.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.time_compute, self.time_comm = state["time_compute"], state["time_comm"]
        self.interval.copy_(state["interval"])
        self.clipped_seen = state["clipped_seen"]
        # Checkpoints written before these statistics existed: count them from here.
        self.step_stats.copy_(state.get("step_stats", torch.zeros_like(self.step_stats)))
        self.move_from = devices.move(state.get("move_from"), self.device)
        self.path.copy_(state.get("path", torch.zeros_like(self.path)))
