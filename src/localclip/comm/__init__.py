"""Communication: one small interface, over torch.distributed or over simulated workers.

Algorithms talk to peers only through :class:`Communicator` (``all_reduce``, ``broadcast``,
``all_to_all``, ``all_gather``, and the non-blocking ``start_*`` forms that return a
:class:`Pending`);
:mod:`localclip.comm.distributed` implements it over a ``torch.distributed`` process group and
:mod:`localclip.comm.simulated` over N worker threads of one process; :mod:`localclip.comm.launch`
starts the workers that talk through them (the runtimes: simulate, spawn, torchrun, ft).
"""

from localclip.comm import distributed  # noqa: F401 - registers the fallback for user-made groups
from localclip.comm.base import DEFAULT_TIMEOUT, Communicator, Pending, SingleProcess, current, install, use
from localclip.comm.simulated import SimulatedCommunicator, SimulatedWorld

__all__ = [
    "DEFAULT_TIMEOUT",
    "Communicator",
    "Pending",
    "SingleProcess",
    "SimulatedCommunicator",
    "SimulatedWorld",
    "current",
    "install",
    "use",
]
