"""Periodic model averaging: when the workers average, what they send, and what a round does.

:class:`PeriodicAverager` (:mod:`.averager`) owns the "every I steps, replace the model by the
average" part of CELGC and of local SGD, composed from small parts, each in its own module:

* :mod:`.schedule` — which steps end with a round (period, warm-up), and whether a round now
  would send anything new;
* :mod:`.buffers` — the averaged tensors re-homed, once, into one flat buffer per (device,
  dtype), so that a plain round is one pass and one in-place all-reduce;
* :mod:`.round` — one round: who takes part (partial participation), leaving out a worker with
  non-finite values, chunking the all-reduce, and the work on the sum block by block;
* :mod:`.compression` — sending the change since the last round in 2 bytes (bf16, fp16);
* :mod:`.fragments` — streaming fragments: the tensors split into P parts with staggered rounds;
* :mod:`.overlap` — rounds in flight: started without waiting, merged tau steps later (mix or carry);
* :mod:`localclip.outer` — an outer step on the average (DiLoCo);
* :mod:`.optimizer_state` — what a round does to the inner optimizer's state.

Each choice's allowed values live here: :data:`COMPRESSIONS`, :data:`OPTIMIZER_STATE_MODES`, :data:`OVERLAP_MERGES`.
"""

from localclip.averaging.averager import PeriodicAverager
from localclip.averaging.buffers import BLOCK_NUMEL
from localclip.averaging.compression import COMPRESSIONS
from localclip.averaging.optimizer_state import OPTIMIZER_STATE_MODES
from localclip.averaging.overlap import MERGES as OVERLAP_MERGES
from localclip.averaging.round import DEFAULT_CHUNK_BYTES, OUTER_CHUNK_BYTES
from localclip.data.sharding import sample_participants

__all__ = [
    "BLOCK_NUMEL", "COMPRESSIONS", "DEFAULT_CHUNK_BYTES", "OPTIMIZER_STATE_MODES", "OUTER_CHUNK_BYTES", "OVERLAP_MERGES", "PeriodicAverager",
    "sample_participants",
]
