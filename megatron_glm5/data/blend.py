"""Dataset blends: the ways a list of Megatron prefixes with (optional) weights may be written, to one form."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["Blend", "normalize_blend"]

Blend = Union[str, Sequence[Union[str, Tuple[str, float], Tuple[float, str]]], Dict[str, float]]


def normalize_blend(prefixes_with_weights: Blend) -> Tuple[List[str], Optional[List[float]]]:
    """``(prefixes, weights or None)`` from any of: ``"prefix"``; ``["p1", "p2"]``; ``[("p1", 0.8), ("p2", 0.2)]``
    (or ``(weight, prefix)`` pairs); ``{"p1": 0.8, "p2": 0.2}``; Megatron's flat ``["0.8", "p1", "0.2", "p2"]``."""
    spec = prefixes_with_weights
    if isinstance(spec, (str, os.PathLike)):
        return [os.fspath(spec)], None
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = list(spec)
    if not items:
        raise ValueError("empty dataset blend: give at least one data prefix")
    if all(isinstance(x, (str, os.PathLike)) for x in items):
        flat = [os.fspath(x) for x in items]
        if len(flat) % 2 == 0 and all(_is_number(flat[i]) for i in range(0, len(flat), 2)):
            prefixes, weights = flat[1::2], [float(w) for w in flat[0::2]]
        else:
            return flat, None
    else:
        prefixes, weights = [], []
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"blend entry {item!r}: expected (prefix, weight)")
            a, b = item
            if isinstance(a, (int, float)) and not isinstance(b, (int, float)):
                a, b = b, a
            prefixes.append(os.fspath(a))
            weights.append(float(b))
    for p, w in zip(prefixes, weights):
        if not w > 0:
            raise ValueError(f"blend weight of {p!r} must be > 0, got {w}")
    if len(prefixes) == 1:
        weights = None
    return prefixes, weights


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
