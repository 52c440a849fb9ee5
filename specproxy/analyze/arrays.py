"""Columns of figures made ready for the statistics: missing values dropped, labels coded, levels checked.

Why one module: every estimator (``stats``, ``aggregate``, ``throughput``) must treat a missing figure
(None, NaN) the same way, dropped and never read as 0, and refuse an infinite one.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from specproxy.store.turns import first_seen

__all__ = ["BOOT_CHUNK", "Coded", "check_level", "clean", "clean_labelled", "coded", "finite", "floats", "missing",
           "stable_argsort", "take_last"]

BOOT_CHUNK = 4_000_000  # array elements per chunk in O(n_boot * n) bootstraps: bounded memory


def take_last(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``np.take_along_axis(a, idx, axis=-1)``, ``a``'s leading axes broadcasting to ``idx``'s (``a`` of
    shape (k, 1, n) against ``idx`` (k, r, m)), as one gather from the flattened array: the bootstraps
    and schedule replays gather millions of elements, and take_along_axis's per-axis fancy index costs
    about three times as much."""
    lead = a.shape[:-1]
    if math.prod(lead) == 1:  # one row: no offsets to add (a copy of the indexes)
        return np.take(a.reshape(-1), idx)
    offsets = (np.arange(math.prod(lead), dtype=np.int64) * a.shape[-1]).reshape(lead + (1,))
    return np.take(np.ascontiguousarray(a).reshape(-1), idx + offsets)


def stable_argsort(x: np.ndarray) -> np.ndarray:
    """``np.argsort(x, axis=-1, kind="stable")``, the same permutation, at the cost of the default sort:
    numpy's stable sort of floats is a merge sort (timsort), three to four times slower than its
    vectorised quicksort on values in no order (0.33 s against 0.09 s for a million here); the
    quicksort's order differs only among equal values, which are put back in position order, a sort of
    those few alone. Values already nearly in order (turns' starts and ends) are timsort's best case:
    sort those with numpy's."""
    order = np.argsort(x, axis=-1)
    xs = np.take_along_axis(x, order, axis=-1)
    tie = xs[..., 1:] == xs[..., :-1]
    if xs.dtype.kind == "f":
        tie |= np.isnan(xs[..., 1:]) & np.isnan(xs[..., :-1])
    if not tie.any():
        return order
    member = np.zeros(x.shape, dtype=bool)  # in a run of equal values
    member[..., 1:] |= tie
    member[..., :-1] |= tie
    starts = member.copy()
    starts[..., 1:] &= ~tie
    run = np.cumsum(starts[member])  # runs numbered along the rows, in order (a start is a member)
    at = order[member]
    order[member] = at[np.argsort(run * x.shape[-1] + at)]  # each run's positions ascending
    return order


def _as_floats(values: Iterable[Any] | None) -> np.ndarray:
    return np.asarray(values if isinstance(values, np.ndarray) else list(values or []), dtype=float).reshape(-1)


INFINITE = "infinite value: a missing figure must be None/NaN, not inf"


def _refuse_inf(arr: np.ndarray) -> None:
    if np.isinf(arr).any():
        raise ValueError(INFINITE)


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


class Coded:
    """Labels as integer codes into their distinct values (``values[codes[i]]`` is the i-th label; codes
    0..len(values)-1, values distinct). Why: the server instance of each of a month's turns is one of a
    handful of values, and a Python object per turn made the instance rows of ``compare`` walk millions
    of objects (dict lookups, a sort of strings); the store hands text columns over as codes already."""

    __slots__ = ("codes", "values", "_distinct")

    def __init__(self, codes: np.ndarray, values: tuple):
        self.codes, self.values, self._distinct = codes, tuple(values), None

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, mask: Any) -> Coded:
        return Coded(self.codes[mask], self.values)

    def distinct(self) -> set:
        """The values some label holds (counted once: compare asks for an arm's instances in several places)."""
        if self._distinct is None:
            present = np.bincount(self.codes, minlength=len(self.values))
            self._distinct = frozenset(self.values[c] for c in np.flatnonzero(present).tolist())
        return set(self._distinct)


def coded(labels: Iterable[Any] | Coded) -> Coded:
    """Labels as ``Coded`` (first-seen order; a None label is a value like any other)."""
    if isinstance(labels, Coded):
        return labels
    table: dict[Any, int] = {}
    codes = np.fromiter((table.setdefault(l, len(table)) for l in labels), dtype=np.int64)
    return Coded(codes, tuple(table))


def _first_seen(codes: np.ndarray, k: int) -> np.ndarray:
    """The codes present in ``codes`` (each below ``k``), in the order they first occur."""
    return first_seen(codes, np.flatnonzero(np.bincount(codes, minlength=k)))


def clean_labelled(values, labels) -> tuple[np.ndarray, np.ndarray | None, list]:
    """Drop missing values with their labels; labels become codes 0..k-1 in the order the kept values'
    labels first occur (third: the originals, in that order). ``labels``: any sequence, or ``Coded``.

    A None label is one more instance (unknown, but not the same as a known one)."""
    arr = floats(values)
    keep = ~np.isnan(arr)
    if labels is None:
        return arr[keep], None, []
    labels = coded(labels)
    if len(labels) != arr.size:
        raise ValueError(f"{len(labels)} cluster labels for {arr.size} values")
    everything = bool(keep.all())
    kept = labels.codes if everything else labels.codes[keep]
    used = _first_seen(kept, len(labels.values))
    renumber = np.zeros(len(labels.values), dtype=np.int64)
    renumber[used] = np.arange(len(used))
    return (arr if everything else arr[keep]), renumber[kept], [labels.values[i] for i in used.tolist()]


def missing(v: Any) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and math.isnan(v))


def check_level(level: float) -> None:
    if not 0.5 < level < 1:
        raise ValueError(f"level must be in (0.5, 1), got {level}")
