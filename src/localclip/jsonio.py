"""Standard JSON for the files other tools read (``summary.json``, ``metrics.jsonl``, results).

JSON has no infinity and no NaN; Python's ``json`` writes them as the bare words ``Infinity`` and
``NaN``, which strict parsers (``jq``, JavaScript's ``JSON.parse``, most other languages) reject.
Here a non-finite float is written as a string: ``"inf"``, ``"-inf"`` or ``"nan"`` (what
``float()`` reads back in Python, ``float(value)``). A diverged run's ``val/ppl`` is ``"inf"``.

:func:`loads` reads both that encoding and files written with the bare words, turning the three
strings back into floats.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["NONFINITE", "decode", "dumps", "encode", "loads"]

#: The strings that stand for the non-finite floats.
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode_float(x: float) -> Any:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def encode(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth) replaced by its string."""
    if isinstance(obj, float):
        return _encode_float(obj)
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def decode(obj: Any) -> Any:
    """``obj`` with the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (at any depth) made floats."""
    if isinstance(obj, str):
        return NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """Standard JSON (``allow_nan=False``), non-finite floats written as strings."""
    return json.dumps(encode(obj), allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """Parse JSON written by :func:`dumps` or with Python's bare ``Infinity``/``NaN``."""
    return decode(json.loads(text))
