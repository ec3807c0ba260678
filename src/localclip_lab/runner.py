"""Running a sweep: its runs into one folder, up to ``jobs`` at once, resumable.

Layout::

    ROOT/NAME/sweep.json    the planned runs and their status (rewritten atomically, by this process only)
    ROOT/NAME/RUN/          one run folder per run (see :mod:`localclip.train.run_folder`)

:func:`run_sweep` skips finished runs (``summary.json``), resumes started ones from their latest
checkpoint and starts the rest, so an interrupted sweep is continued by running it again. It
owns no training logic: it resolves each run's config once
(:func:`localclip.algorithms.build.resolved`), and that resolved config serves the checks, the
status file, the lines it prints and the run, which is one :func:`localclip.train.run_resolved`
call, in this process when ``jobs`` is 1, else in a child process (``python -m localclip_lab.runner``,
handed the resolved config) per run, at most ``jobs`` at a time. One sweep process per sweep folder.

Concurrent runs split the machine's cores: run slot ``s`` of ``jobs`` is bound (CPU affinity)
to its own share of the cores, so runs do not fight over them. The sweeps pin one intra-op
thread per worker (see :mod:`localclip_lab.plans`), so neither the binding nor ``jobs``
changes a number: a sweep's results are the same whatever ``jobs``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from localclip import jsonio
from localclip.algorithms import build
from localclip.algorithms.build import communication_period
from localclip.averaging.codecs import LOWBIT
from localclip.errors import Interrupted, LocalclipError
from localclip_lab.plans import Plan, SweepError, SweepFailed, plan, select
from localclip.train import run_resolved
from localclip.train.config import TrainConfig, apply_overrides, config_from_dict
from localclip.train.run_folder import RunFolder, atomic_write_text

__all__ = ["available_cores", "core_slots", "default_jobs", "plan_lines", "run_sweep"]

_POLL = 0.2  # seconds between checks on the child runs
_STOP_GRACE = 30.0  # seconds an interrupted child gets to stop on its own before it is killed


def available_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_jobs(runs: int, cores: int | None = None) -> int:
    """One run per core, at most one per run to do.

    Why this is the fastest choice: every sweep run pins one intra-op thread per worker, so one
    run keeps about one core busy under turn-taking simulation, and N concurrent worker threads
    bound to one core under concurrent simulation keep that core busy without oversubscribing
    the others (a worker waiting in a collective yields its core to the run's other workers).
    Fewer jobs than cores leaves cores idle; more puts two runs on one core for no gain and
    twice the memory. Measured on the project's 2-core machine (``benchmarks/bench_sweep_jobs.py``,
    2 runs of N = 8 for 24 steps, under other jobs' load): 118.6 s at J = 1, 84.7 s at J = 2
    (1.40x), 86.3 s at J = 4; identical metrics at every J.
    """
    cores = len(available_cores()) if cores is None else cores
    return max(1, min(cores, runs))


def core_slots(jobs: int, cores: Sequence[int]) -> list[list[int]]:
    """The cores of each of ``jobs`` run slots: disjoint, as even as possible, all of them used;
    with more jobs than cores, slots share cores round-robin."""
    cores = list(cores)
    if jobs <= len(cores):
        return [cores[s * len(cores) // jobs : (s + 1) * len(cores) // jobs] for s in range(jobs)]
    return [[cores[s % len(cores)]] for s in range(jobs)]


def _check_jobs(jobs) -> int:
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise SweepError(f"Invalid --jobs: {jobs!r} (expected an integer >= 1: the number of runs at once)")
    return jobs


# -- status ----------------------------------------------------------------------------------------


def _folder_state(folder: Path) -> str:
    run = RunFolder(folder)
    return "finished" if run.finished else "partial" if run.started else "pending"


def _write_status(path: Path, name: str, runs: Plan, selected: list[str], status: dict[str, dict], meta: dict) -> None:
    """``sweep.json`` of ``runs``, each with its resolved config."""
    entries = []
    for run_name, resolved in runs:
        entry = {
            "name": run_name, "algorithm": resolved.algorithm.name, "workers": resolved.algorithm.workers, "period": resolved.round.period,
            "epochs": resolved.schedule.epochs, "selected": run_name in selected, "status": _folder_state(path.parent / run_name),
        }
        entry.update(status.get(run_name, {}))
        entries.append(entry)
    doc = {"sweep": name, **meta, "runs": entries, "failed": [e["name"] for e in entries if e["status"] == "failed"]}
    atomic_write_text(path, jsonio.dumps(doc, indent=2) + "\n")


# -- the sweep -------------------------------------------------------------------------------------


def run_sweep(
    name: str,
    root: str | os.PathLike,
    *,
    epochs: float | None = None,
    runtime: str = "simulate",
    data_root: str | None = None,
    only: Sequence[str] | None = None,
    progress: bool = False,
    max_steps: int | None = None,
    overrides: Sequence[str] = (),
    jobs: int | None = 1,
    echo: Callable[[str], None] = print,
    fetch_corpus: Callable[[TrainConfig], object] | None = None,
) -> dict[str, str]:
    """Run the sweep ``name`` into ``root/name``; return each selected run's outcome
    (``skipped``, ``started``, ``resumed``, ``failed``).

    ``only`` restricts it to some runs; ``max_steps`` and ``overrides`` (``KEY=VALUE`` as with
    ``--set``) apply to every run (smoke tests). ``jobs``: runs at once (``None``:
    :func:`default_jobs`); 1 runs them one after another in this process. A run that fails is
    reported and the sweep goes on; :class:`SweepFailed` is raised at the end if any did.
    ``data_root`` is the config's: the corpora's folder for PTB, the IDX files' folder for
    Fashion-MNIST. ``fetch_corpus(config)``, if given, is called once for each corpus of the
    selected language-model runs, after every config has been checked and before anything is
    written (the ``localclip sweep`` command downloads a missing corpus there).
    """
    if jobs is not None:
        _check_jobs(jobs)
    changes = {k: v for k, v in (("max_steps", max_steps), ("data_root", data_root)) if v is not None}
    # Every config as it will run, resolved once and checked before anything is written (a bad
    # override fails here); what follows reads these resolved configs and never resolves again.
    runs = [(run, build.resolved(apply_overrides(cfg.replace(**changes), list(overrides)))) for run, cfg in plan(name, epochs)]
    selected = select(name, runs, only)
    if fetch_corpus is not None:
        corpora = {(cfg.workload.dataset, cfg.workload.data_root): cfg for run, cfg in runs if run in selected and cfg.workload.task == "lm"}
        for cfg in corpora.values():
            fetch_corpus(cfg)
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    status_path = folder / "sweep.json"
    todo = [(run, cfg) for run, cfg in runs if run in selected]
    to_train = [run for run, _ in todo if not RunFolder(folder / run).finished]
    jobs = default_jobs(len(to_train)) if jobs is None else jobs
    meta = {"epochs": epochs, "runtime": runtime, "max_steps": max_steps, "overrides": list(overrides), "jobs": jobs}
    sweep = _Sweep(name, folder, runs, selected, meta, echo)
    sweep.save()
    pending = []
    for index, (run_name, cfg) in enumerate(todo, 1):
        tag = f"[{index}/{len(todo)}] {name}/{run_name}"
        run = RunFolder(folder / run_name)
        if run.finished:
            sweep.outcomes[run_name] = "skipped"
            echo(f"{tag}: finished earlier, skipped{_epochs_note(run, cfg)}")
        else:
            pending.append((tag, run_name, cfg))
    if jobs == 1:
        for tag, run_name, cfg in pending:
            sweep.run_here(tag, run_name, cfg, runtime, progress)
    else:
        sweep.run_children(pending, runtime, jobs)
    if sweep.failures:
        raise SweepFailed(name, sweep.failures)
    return sweep.outcomes


class _Sweep:
    """The bookkeeping of one sweep invocation: outcomes, failures and ``sweep.json``. Every
    config it holds or is handed is resolved."""

    def __init__(self, name: str, folder: Path, runs: Plan, selected: list[str], meta: dict, echo):
        self.name, self.folder, self.runs, self.selected, self.meta, self.echo = name, folder, runs, selected, meta, echo
        self.status: dict[str, dict] = {}
        self.outcomes: dict[str, str] = {}
        self.failures: dict[str, str] = {}

    def save(self) -> None:
        _write_status(self.folder / "sweep.json", self.name, self.runs, self.selected, self.status, self.meta)

    def starting(self, tag: str, run_name: str, cfg: TrainConfig, where: str = "") -> bool:
        resume = RunFolder(self.folder / run_name).started
        self.outcomes[run_name] = "resumed" if resume else "started"
        self.echo(f"{tag}: {'resuming' if resume else 'starting'} ({_short(cfg)}) in {self.folder / run_name}{where}")
        self.status[run_name] = {"status": "running"}
        self.save()
        return resume

    def failed(self, tag: str, run_name: str, error: str, trace: str | None) -> None:
        self.failures[run_name] = error
        self.outcomes[run_name] = "failed"
        self.status[run_name] = {"status": "failed", "error": error}
        if trace:
            self.status[run_name]["traceback"] = trace
        self.echo(f"{tag}: FAILED: {error}")
        self.save()

    def done(self, tag: str, run_name: str, summary: dict | None) -> None:
        self.status.pop(run_name, None)
        self.echo(f"{tag}: done ({_result(summary)})")
        self.save()

    def interrupted(self, names) -> None:
        for run_name in names:
            self.status[run_name] = {"status": "interrupted"}
        self.save()

    # -- one run at a time, here ---------------------------------------------------------------

    def run_here(self, tag: str, run_name: str, cfg: TrainConfig, runtime: str, progress: bool) -> None:
        resume = self.starting(tag, run_name, cfg)
        try:
            summary = run_resolved(cfg, self.folder / run_name, runtime=runtime, resume=resume, progress=progress)
        except (KeyboardInterrupt, Interrupted):  # a stop request ends the sweep, not just this run
            self.interrupted([run_name])
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the others
            error = str(exc) if isinstance(exc, LocalclipError) else f"{type(exc).__name__}: {exc}"
            self.failed(tag, run_name, error, None if isinstance(exc, LocalclipError) else traceback.format_exc())
        else:
            self.done(tag, run_name, summary)

    # -- several at once, in child processes -----------------------------------------------------

    def run_children(self, pending: list, runtime: str, jobs: int) -> None:
        slots = core_slots(jobs, available_cores())
        free = list(range(jobs))
        running: dict[int, tuple] = {}  # slot -> (tag, run name, process, spec folder, log file)
        queue = list(pending)
        with tempfile.TemporaryDirectory(prefix=f"localclip-sweep-{self.name}-") as tmp, _sigterm_stops_the_sweep():
            try:
                while queue or running:
                    while queue and free:
                        slot = free.pop(0)
                        tag, run_name, cfg = queue.pop(0)
                        where = f" [cores {','.join(map(str, slots[slot]))}]"
                        resume = self.starting(tag, run_name, cfg, where)
                        running[slot] = (tag, run_name, *_start_child(Path(tmp) / run_name, cfg, self.folder / run_name, runtime, resume, slots[slot]))
                    time.sleep(_POLL)
                    for slot, (tag, run_name, proc, spec, log) in list(running.items()):
                        if proc.poll() is None:
                            continue
                        log.close()
                        del running[slot]
                        free.append(slot)
                        self._collect(tag, run_name, proc.returncode, spec)
            except BaseException:
                # Interrupted (Ctrl-C, or the sweep's own failure): stop the children, which
                # checkpoint as the trainer allows; the next invocation resumes them.
                for _, _, proc, _, _ in running.values():
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                deadline = time.monotonic() + _STOP_GRACE
                for _, _, proc, _, log in running.values():
                    try:
                        proc.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    log.close()
                self.interrupted([run_name for _, run_name, *_ in running.values()])
                raise

    def _collect(self, tag: str, run_name: str, returncode: int, spec: Path) -> None:
        result_path = spec / "result.json"
        if returncode == Interrupted.exit_code and not result_path.exists():
            # Stopped on its own signal (not the sweep's), checkpointed: resumable, not failed.
            self.echo(f"{tag}: interrupted (checkpointed; run the sweep again to resume it)")
            self.interrupted([run_name])
            return
        try:
            result = jsonio.loads(result_path.read_text())
        except (OSError, json.JSONDecodeError):
            tail = _tail(spec / "log.txt")
            self.failed(tag, run_name, f"the run's process exited with code {returncode} without a result" + (f"; its last output: {tail}" if tail else ""), None)
            return
        if result["status"] == "ok":
            self.done(tag, run_name, result.get("summary"))
        else:
            self.failed(tag, run_name, result["error"], result.get("traceback"))


@contextmanager
def _sigterm_stops_the_sweep():
    """SIGTERM (a scheduler's stop, ``kill``) stops the sweep as Ctrl-C does: the children are
    asked to checkpoint and marked interrupted. Python's default would end this process at once
    and leave its children training, unseen by the next invocation."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM (checkpoint and stop) when the sweep process dies, even by
    SIGKILL: an orphaned run would go on writing into a folder the next sweep resumes (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the sweep died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _start_child(spec: Path, cfg: TrainConfig, out: Path, runtime: str, resume: bool, cores: list[int]):
    spec.mkdir(parents=True)
    job = {"config": cfg.to_dict(), "out": str(out), "runtime": runtime, "resume": resume, "cores": cores,
           "result": str(spec / "result.json"), "parent": os.getpid()}
    (spec / "job.json").write_text(jsonio.dumps(job))
    log = open(spec / "log.txt", "wb")
    # A new session: a Ctrl-C in the terminal reaches the sweep alone, which then stops each
    # child itself (and marks it interrupted) instead of racing them.
    proc = subprocess.Popen([sys.executable, "-m", "localclip_lab.runner", str(spec / "job.json")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, spec, log


def _tail(path: Path, chars: int = 600) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return text[-chars:].replace("\n", " | ")


def _child(job_path: str) -> int:
    """One run of a sweep in this (child) process, as :meth:`_Sweep.run_here` would run it: the
    job holds the config the sweep resolved."""
    job = jsonio.loads(Path(job_path).read_text())
    if job.get("parent"):
        _stop_with_parent(job["parent"])
    if job.get("cores") and hasattr(os, "sched_setaffinity"):
        import torch

        os.sched_setaffinity(0, job["cores"])
        # The process's thread budget is its share of the cores: simulated workers compute at
        # most that many at once. Each worker's own intra-op threads stay the config's (threads=1
        # in every sweep), so this changes speed only, never a number.
        torch.set_num_threads(len(job["cores"]))
    result: dict
    try:
        summary = run_resolved(config_from_dict(job["config"]), job["out"], runtime=job["runtime"], resume=job["resume"], progress=False)
        result = {"status": "ok", "summary": summary}
    except Interrupted:
        return Interrupted.exit_code  # checkpointed: the next invocation resumes it, no result
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - reported to the sweep with its traceback
        error = str(exc) if isinstance(exc, LocalclipError) else f"{type(exc).__name__}: {exc}"
        result = {"status": "failed", "error": error, "traceback": None if isinstance(exc, LocalclipError) else traceback.format_exc()}
    atomic_write_text(Path(job["result"]), jsonio.dumps(result))
    return 0


# -- lines for people ------------------------------------------------------------------------------


def _epochs_note(run: RunFolder, cfg: TrainConfig) -> str:
    try:
        done = jsonio.loads(run.config_path.read_text()).get("epochs")
    except (OSError, json.JSONDecodeError):
        return ""
    if done != cfg.schedule.epochs:
        return f" (it ran {done} epochs, the plan now says {cfg.schedule.epochs}: delete {run.path} to redo it)"
    return ""


def _short(r: TrainConfig) -> str:
    """One line of the resolved config ``r``: what the run is."""
    every = communication_period(r)
    period = "" if every is None else f" I={every}"
    text = f"{r.algorithm.name} N={r.algorithm.workers}{period} η={r.local.lr:g} γ={r.local.gamma:g} epochs={r.schedule.epochs:g}"
    if r.schedule.lr_decay_epochs:
        text += f" decay×{r.schedule.lr_decay:.3g}@{r.schedule.lr_decay_epochs[0]}..{r.schedule.lr_decay_epochs[-1]}"
    if r.workload.model_options.get("dropout"):
        text += f" dropout={r.workload.model_options['dropout']:g}"
    if r.workload.model_options.get("norm"):
        text += f" norm={r.workload.model_options['norm']}"
    if r.local.momentum:
        text += f" μ={r.local.momentum:g}"
    if r.workload.heterogeneous:
        text += " heterogeneous"
    if r.round.participants:
        text += f" K={r.round.participants}"
        if r.round.non_participants == "idle":
            text += " idle"
    if r.run.seed != 2020:
        text += f" seed={r.run.seed}"
    if r.local.inner_optimizer != "clipped_sgd":
        text += f" {r.local.inner_optimizer}(clip={r.local.max_grad_norm:g})"
    if r.round.outer_optimizer != "none":
        text += f" outer={r.round.outer_optimizer}(lr={r.round.outer_lr:g}{' decaying' if r.round.outer_lr_decay else ''}, μ={r.round.outer_momentum:g})"
    if r.round.warmup_steps:
        text += f" warmup={r.round.warmup_steps}"
    if r.evaluation.asgd_patience:
        text += f" asgd(patience={r.evaluation.asgd_patience})"
    if r.round.compression != "none":
        text += f" compression={r.round.compression}" + ("" if r.round.error_feedback or r.round.compression not in LOWBIT else " no-error-feedback")
    if r.round.fragments != 1:
        text += f" P={r.round.fragments}"
    if r.round.overlap:
        text += f" overlap={r.round.overlap}" + (f" α={r.round.overlap_alpha:g}" if r.round.overlap_alpha else "")
        text += " carry" if r.round.overlap_merge == "carry" else ""
    if r.schedule.max_steps:
        text += f" max_steps={r.schedule.max_steps}"
    return text


def _result(summary: dict | None) -> str:
    if not summary:
        return "no summary"
    keys = ("val/ppl", "test/ppl", "val/acc", "test/acc", "steps", "comm/rounds")
    return " ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys if k in summary)


def plan_lines(name: str, root: str | os.PathLike | None = None, epochs: float | None = None, only: Sequence[str] | None = None) -> list[str]:
    """One line per planned run (``--list``), with its folder's state when ``root`` is given."""
    lines = []
    for run_name, cfg in plan(name, epochs, only):
        state = f"  [{_folder_state(Path(root) / name / run_name)}]" if root is not None else ""
        lines.append(f"{run_name:24s} {_short(build.resolved(cfg))}{state}")
    return lines


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
