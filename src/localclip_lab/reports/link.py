"""The modelled link of a sweep's report: how measured compute time and counted bytes become
modelled wall-clock seconds (a latency per round and the bytes over a link of some bandwidth).
"""

from __future__ import annotations

from localclip.averaging.codecs import LOWBIT, encoded_nbytes

__all__ = ["AWD_MESSAGE_BYTES", "BANDWIDTH", "LATENCY", "LINKS", "WIRE_FRACTION", "modelled_at", "seconds_to"]

# The link that turns measured compute time and counted bytes into modelled wall-clock time.
BANDWIDTH = 1e9  # bit/s
LATENCY = 50e-6  # s per round
# converge: two links, and the message of the paper's AWD-LSTM (24M float32 parameters, 97 MB a round).
LINKS = {"1 Gbit/s": 1e9, "10 Gbit/s": 10e9}
AWD_MESSAGE_BYTES = 97e6
# What a compressed round sends, as a fraction of float32 (the 97 MB message shrinks with it);
# low-bit rounds: codes plus one float32 scale per block, for AWD-LSTM's message.
WIRE_FRACTION = {"none": 1.0, "bf16": 0.5, "fp16": 0.5,
                 **{name: encoded_nbytes(int(AWD_MESSAGE_BYTES) // 4, bits) / AWD_MESSAGE_BYTES for name, bits in LOWBIT.items()}}


def modelled_at(record: dict, train: list[dict]) -> float:
    """Modelled seconds at ``record``; an evaluation record takes the compute time of the last
    training record at or before its step (as the figure does)."""
    from localclip.plot import modelled_seconds

    if "time/compute" in record:
        return modelled_seconds(record, bandwidth=BANDWIDTH, latency=LATENCY)
    before = [t for t in train if t["step"] <= record["step"]]
    compute = before[-1].get("time/compute", 0.0) if before else 0.0
    return modelled_seconds(record, bandwidth=BANDWIDTH, latency=LATENCY, compute=compute)


def seconds_to(hit: dict | None, per_step: float | None, bandwidth: float, message: float | None, overlap: int = 0) -> float | None:
    """Modelled seconds to the record ``hit``: compute per local step, and per round a latency and
    its bytes over a link of ``bandwidth`` bit/s (``message`` bytes a round, or the bytes the run
    counted when None). A round in flight for ``overlap`` steps (streaming rounds) costs only what
    of its time exceeds that much compute."""
    if hit is None or per_step is None:
        return None
    rounds = hit.get("comm/rounds", 0)
    nbytes = hit.get("comm/bytes", 0) if message is None else rounds * message
    if overlap and rounds:
        return hit["step"] * per_step + rounds * max(0.0, LATENCY + nbytes * 8 / bandwidth / rounds - overlap * per_step)
    return hit["step"] * per_step + rounds * LATENCY + nbytes * 8 / bandwidth
