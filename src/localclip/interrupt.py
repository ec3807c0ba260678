"""Stop requests: SIGTERM and SIGINT turned into "finish the step, checkpoint, exit".

A cluster scheduler sends SIGTERM before it preempts a job, and Ctrl-C sends SIGINT. While
:func:`catch` is active in a process, the first such signal only records a request; the training
loop reads it with :func:`requested` at its agreement points, the workers agree on the stop step
with one all-reduce, write a checkpoint and raise :class:`~localclip.errors.Interrupted`. A
second signal exits the process at once (status 128 + signal number) without writing anything:
checkpoints are written to temporary names and renamed, so the last complete one stays intact.

The request is process-wide (signal handlers are): the simulated workers, threads of one
process, all read the same one. A spawning parent registers its children with :func:`forward_to`
and passes each signal on to them.

One signal often arrives twice: Ctrl-C reaches every process of the terminal's group, and a
launcher (torchrun, the spawning parent) passes it on as well. Repeats within
:data:`REPEAT_WINDOW` seconds of the first therefore count as the same signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

__all__ = ["REPEAT_WINDOW", "SIGNALS", "catch", "forward_to", "requested", "reset"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW = 1.0  # seconds

_state = {"signum": 0, "at": 0.0, "children": [], "announce": True}


def requested() -> int:
    """The number of the signal that asked this process to stop, or 0."""
    return _state["signum"]


def reset() -> None:
    """Forget a request (a new run in the same process starts clean)."""
    _state["signum"], _state["at"] = 0, 0.0


def _say(text: str) -> None:
    if _state["announce"]:
        # On a line of its own: a progress bar may hold the current one.
        print(f"\nlocalclip: {text}", file=sys.stderr, flush=True)


def _signal_children(signum: int) -> None:
    for pid in list(_state["children"]):
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _handler(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    name = signal.Signals(signum).name
    now = time.monotonic()
    if not _state["signum"]:
        _state["signum"], _state["at"] = signum, now
        _signal_children(signum)
        _say(f"{name} received: finishing the current step, then checkpointing and stopping at the next "
             f"agreement point (send it again to exit at once)")
        return
    if now - _state["at"] < REPEAT_WINDOW:
        return  # the same signal delivered twice (terminal and launcher)
    _signal_children(signal.SIGKILL)
    _say(f"second {name}: exiting at once; the last complete checkpoint is kept")
    os._exit(128 + signum)


@contextlib.contextmanager
def catch(announce: bool = True):
    """Within this block, SIGTERM/SIGINT request a stop instead of killing the process.

    Only the main thread may install signal handlers; elsewhere this does nothing (the default
    behaviour stays). ``announce=False`` keeps the process quiet (a worker whose launcher speaks).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    reset()
    _state["announce"] = announce
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _state["announce"] = True
        reset()  # a request belongs to the block it came in


@contextlib.contextmanager
def forward_to(pids: list[int]):
    """Within this block, signals caught by :func:`catch` are passed on to the processes ``pids``;
    a second one kills them."""
    _state["children"] = list(pids)
    try:
        # A request that came before the children existed is theirs too.
        if _state["signum"]:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, _state["signum"])
        yield
    finally:
        _state["children"] = []
