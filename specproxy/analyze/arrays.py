"""Columns of figures made ready for the statistics: missing values dropped, labels coded, levels checked.

Why one module: every estimator (``stats``, ``aggregate``, ``throughput``) must treat a missing figure
(None, NaN) the same way, dropped and never read as 0, and refuse an infinite one.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

__all__ = ["BOOT_CHUNK", "check_level", "clean", "clean_labelled", "finite", "floats", "missing", "take_last"]

BOOT_CHUNK = 4_000_000  # array elements per chunk in O(n_boot * n) bootstraps: bounded memory


def take_last(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``np.take_along_axis(a, idx, axis=-1)``, ``a``'s leading axes broadcasting to ``idx``'s (``a`` of
    shape (k, 1, n) against ``idx`` (k, r, m)), as one gather from the flattened array: the bootstraps
    and schedule replays gather millions of elements, and take_along_axis's per-axis fancy index costs
    about three times as much."""
    lead = a.shape[:-1]
    offsets = (np.arange(math.prod(lead), dtype=np.int64) * a.shape[-1]).reshape(lead + (1,))
    return np.take(np.ascontiguousarray(a).reshape(-1), idx + offsets)


def _as_floats(values: Iterable[Any] | None) -> np.ndarray:
    return np.asarray(values if isinstance(values, np.ndarray) else list(values or []), dtype=float).reshape(-1)


def _refuse_inf(arr: np.ndarray) -> None:
    if np.isinf(arr).any():
        raise ValueError("infinite value: a missing figure must be None/NaN, not inf")


def floats(values: Iterable[Any] | None) -> np.ndarray:
    """Values as float64; None and NaN become NaN (the caller drops them); inf is an error."""
    arr = _as_floats(values)
    _refuse_inf(arr)
    return arr


def clean(values: Iterable[Any] | None) -> np.ndarray:
    arr = floats(values)
    return arr[~np.isnan(arr)]


def finite(values: Iterable[Any] | None) -> np.ndarray:
    """``clean``'s values, but the input array itself (no copy) when none is missing: for readers only
    (a summary partitions a copy and sums in place), so that a 10M-turn column is not copied first.
    One pass when nothing is missing, where ``clean`` makes three and a copy."""
    arr = _as_floats(values)
    keep = np.isfinite(arr)
    if keep.all():
        return arr
    _refuse_inf(arr)
    return arr[keep]


def clean_labelled(values, labels) -> tuple[np.ndarray, np.ndarray | None, list]:
    """Drop missing values with their labels; labels become codes 0..k-1 (third: originals).

    A None label is one more instance (unknown, but not the same as a known one)."""
    arr = floats(values)
    keep = ~np.isnan(arr)
    if labels is None:
        return arr[keep], None, []
    labels = list(labels)
    if len(labels) != arr.size:
        raise ValueError(f"{len(labels)} cluster labels for {arr.size} values")
    codes: dict[Any, int] = {}
    kept = [codes.setdefault(l, len(codes)) for l, k in zip(labels, keep) if k]
    used, lab = np.unique(np.asarray(kept, dtype=np.int64), return_inverse=True)
    originals = list(codes)
    return arr[keep], lab.reshape(-1).astype(np.int64), [originals[i] for i in used]


def missing(v: Any) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and math.isnan(v))


def check_level(level: float) -> None:
    if not 0.5 < level < 1:
        raise ValueError(f"level must be in (0.5, 1), got {level}")
