"""Periodic model averaging: when the workers average, what they send, and what a round does.

:class:`PeriodicAverager` (:mod:`.averager`) owns the "every I steps, replace the model by the
average" part of CELGC and of local SGD, composed from small parts, each in its own module:

* :mod:`.schedule` — which steps end with a round (period, warm-up), and whether a round now
  would send anything new;
* :mod:`.buffers` — the averaged tensors re-homed, once, into one flat buffer per (device,
  dtype), so that a plain round is one pass and one in-place all-reduce;
* :mod:`.round` — one round over the flat buffers: what each worker sends, the transport, and
  the work on the sum block by block (:func:`average_parameters` is one round of a list of
  tensors, with no averager around it);
* :mod:`.parts` — the parts of a round, from the names users write (:func:`round_parts`);
* :mod:`.codecs` — the wire formats behind one interface: ``none``, ``bf16``, ``fp16``,
  ``int8``, ``int4``, with error feedback;
* :mod:`.outer` — an outer step on the average (DiLoCo);
* :mod:`.participation` — who takes part (partial participation, non-finite workers left out);
* :mod:`.fragments` — streaming fragments: the tensors split into P parts with staggered rounds;
* :mod:`.overlap` — rounds in flight: started without waiting, merged tau steps later (mix or carry);
* :mod:`.optimizer_state` — what a round does to the inner optimizer's state.

Each choice's allowed values live here: :data:`COMPRESSIONS`, :data:`OUTER_OPTIMIZERS`,
:data:`OPTIMIZER_STATE_MODES`, :data:`OVERLAP_MERGES`.
"""

from localclip.averaging.averager import PeriodicAverager
from localclip.averaging.buffers import BLOCK_NUMEL
from localclip.averaging.codecs import COMPRESSIONS, Codec
from localclip.averaging.optimizer_state import OPTIMIZER_STATE_MODES
from localclip.averaging.outer import OUTER_OPTIMIZERS, OuterSGD, TorchOuter
from localclip.averaging.overlap import MERGES as OVERLAP_MERGES
from localclip.averaging.participation import Participation, sample_participants
from localclip.averaging.parts import ROUND_OPTIONS, Streaming, round_parts
from localclip.averaging.round import DEFAULT_CHUNK_BYTES, OUTER_CHUNK_BYTES, average_parameters

__all__ = [
    "BLOCK_NUMEL", "COMPRESSIONS", "Codec", "DEFAULT_CHUNK_BYTES", "OPTIMIZER_STATE_MODES", "OUTER_CHUNK_BYTES", "OUTER_OPTIMIZERS",
    "OVERLAP_MERGES", "OuterSGD", "Participation", "PeriodicAverager", "ROUND_OPTIONS", "Streaming", "TorchOuter", "average_parameters",
    "round_parts", "sample_participants",
]
