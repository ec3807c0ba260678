"""Periodic model averaging: when the workers average, what they send, and what a round does.

:class:`PeriodicAverager` (:mod:`.averager`) owns the "every I steps, replace the model by the
average" part of CELGC and of local SGD, composed of small parts, each in its own module:
:mod:`.schedule` (which steps end with a round), :mod:`.buffers` (the averaged tensors in one
flat buffer per device and dtype), :mod:`.round` (one round; :func:`average_parameters` is one
with no averager around it), :mod:`.parts` (the parts from the names users write), the wire
formats behind one interface in :mod:`.codecs` (none, bf16, fp16, int8, int4, error feedback),
:mod:`.outer` (DiLoCo's outer step), :mod:`.participation` (who takes part), :mod:`.fragments`
and :mod:`.overlap` (streaming rounds), :mod:`.optimizer_state` (the inner optimizer's state at
a round). Each choice's allowed values live here: :data:`COMPRESSIONS`, :data:`OUTER_OPTIMIZERS`,
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
