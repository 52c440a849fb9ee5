"""A report table's cells read in one pass per column: each cell's finite values of a column, and each
cell's aggregate throughput.

Why: a table (by concurrency, prompt length, content class, proxy, server instance) splits up to a month's
ten million turns into a few dozen cells. Cell by cell, each cell's positions were composed with the
selection's, each column gathered at them and then filtered: every column copied twice per table. Here a
column is read once through the selection's positions and each value lands in its cell's part of one
buffer, in row order, so a cell's values are the ones it had, in the order it had them: the same means,
the same order statistics, the same busy periods.

The C path (``_cellsc.c``) runs when it was built; ``finite_by_cell_reference`` and
``throughput_by_cell_reference`` are the plain numpy paths, cell by cell, that it is held to
(``tests/unit/test_cellsc.py``) and that run without a compiler. A cell the C pass cannot vouch for (its
turns not in start order, a token count that is not a whole number) is computed by the reference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specproxy.analyze.arrays import INFINITE
from specproxy.store.dataset import busy_seconds
from specproxy.store.turns import Turns

try:
    from specproxy.analyze import _cellsc
except ImportError:  # no compiler at install: cell by cell, in numpy
    _cellsc = None

__all__ = ["NATIVE", "buckets", "buckets_reference", "cell_counts", "finite_by_cell", "finite_by_cell_reference",
           "release_scratch", "scratch", "text_cells", "text_values", "throughput_by_cell", "throughput_by_cell_reference",
           "throughput_of"]

NATIVE = _cellsc is not None


def _rows(n: int, positions: np.ndarray | None) -> np.ndarray:
    return np.arange(n) if positions is None else positions


def _in_cell(cells: np.ndarray | None, count: int, c: int, mask: np.ndarray | None) -> np.ndarray:
    """Which of ``count`` rows are in cell ``c`` and count (``mask``)."""
    mine = np.full(count, c == 0) if cells is None else (cells == c)
    return mine if mask is None else mine & mask


def cell_counts(cells: np.ndarray, ncell: int, mask: np.ndarray | None = None) -> np.ndarray:
    """How many rows each cell ``0..ncell-1`` holds (``cells`` -1: none; ``mask``: which rows count)."""
    if _cellsc is None:
        keep = cells >= 0 if mask is None else (cells >= 0) & mask
        return np.bincount(cells[keep].astype(np.intp), minlength=ncell)[:ncell]
    return np.array(_cellsc.cell_counts(cells, ncell, mask), dtype=np.int64)


_scratch = threading.local()


def scratch(count: int) -> np.ndarray:
    """``count`` float64 values of this thread's scratch buffer (grown when too small, never shrunk), for
    ``finite_by_cell``'s ``alloc`` when its cells are read and let go of before the next call on the thread:
    a month's column read into fresh memory each time cost as much in page faults as the read itself."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < count:
        buf = _scratch.buf = np.empty(count)
    return buf[:count]


def release_scratch() -> None:
    """Let go of this thread's scratch buffer (a pool's threads let go of theirs when they end)."""
    _scratch.__dict__.pop("buf", None)


def finite_by_cell(values: np.ndarray, positions: np.ndarray | None, cells: np.ndarray | None, ncell: int,
                   mask: np.ndarray | None = None, alloc: Callable[[int], np.ndarray] = np.empty) -> list[np.ndarray]:
    """Per cell ``0..ncell-1``, the ``values`` at its rows but the missing (NaN), in row order: the rows are
    ``positions`` into ``values`` (None: every one), ``cells`` says each row's cell (-1: none; None: every
    row in cell 0), ``mask`` which rows count (None: all). An infinite value is an error, as for ``arrays.finite``
    (a figure is a number or missing). The C path returns views into one buffer from ``alloc(count)``
    (``scratch``: this thread's, valid until its next use)."""
    if _cellsc is None or values.dtype != np.float64:
        return finite_by_cell_reference(values, positions, cells, ncell, mask)
    x, starts, counts, infinite = _cellsc.finite_by_cell(values, positions, cells, ncell, mask, alloc)
    if infinite:
        raise ValueError(INFINITE)
    return [x[s:s + n] for s, n in zip(starts, counts)]


def finite_by_cell_reference(values: np.ndarray, positions: np.ndarray | None, cells: np.ndarray | None,
                             ncell: int, mask: np.ndarray | None = None) -> list[np.ndarray]:
    """``finite_by_cell`` cell by cell: the cell's rows selected, its values gathered, the finite kept."""
    rows = _rows(len(values), positions)
    out = []
    for c in range(ncell):
        v = values[rows[_in_cell(cells, len(rows), c, mask)]]
        if np.isinf(v).any():
            raise ValueError(INFINITE)
        out.append(v[~np.isnan(v)])
    return out


def throughput_of(start: np.ndarray, total_s: np.ndarray, tokens: np.ndarray) -> dict[str, Any]:
    """Delivered tokens / the time at least one of these turns was in flight (``busy_seconds``), over the
    turns with a token count: ``{"n", "tokens", "busy_s", "tps"}`` (None but n when nothing was busy)."""
    end = start + total_s
    known = np.isfinite(tokens)
    n = int(np.count_nonzero(known))
    if n < len(known):  # else every turn counts: no selected copies (the same values, the same sums)
        start, end, tokens = start[known], end[known], tokens[known]
    busy = busy_seconds(start, end)
    return _throughput(n, float(np.sum(tokens)) if n and busy > 0 else 0.0, busy)


def _throughput(n: int, tokens: float, busy: float) -> dict[str, Any]:
    if not n or busy <= 0:
        return {"n": n, "tokens": None, "busy_s": None, "tps": None}
    return {"n": n, "tokens": tokens, "busy_s": busy, "tps": tokens / busy}


def throughput_by_cell(t_wall: np.ndarray, total_s: np.ndarray, tokens: np.ndarray, positions: np.ndarray | None,
                       cells: np.ndarray | None, ncell: int) -> list[dict[str, Any]]:
    """``throughput_of`` each cell's rows (as ``finite_by_cell`` reads rows and cells), from one pass over
    the three columns: each cell's busy periods found as its rows come (they come in start order), then
    added as ``busy_seconds`` adds them."""
    if _cellsc is None or not all(a.dtype == np.float64 for a in (t_wall, total_s, tokens)):
        return throughput_by_cell_reference(t_wall, total_s, tokens, positions, cells, ncell)
    n, summed, exact, in_order, periods, starts, counts = _cellsc.throughput_by_cell(t_wall, total_s, tokens, positions,
                                                                                     cells, ncell, np.empty)
    out = []
    for c in range(ncell):
        if not (exact[c] and in_order[c]):  # numpy's order of additions, or a sort first: the reference's
            out.append(_cell_throughput(t_wall, total_s, tokens, positions, cells, c))
            continue
        busy = float(np.sum(periods[starts[c]:starts[c] + counts[c]])) if counts[c] else 0.0
        out.append(_throughput(n[c], summed[c], busy))  # whole numbers: the sum is exact in any order
    return out


def throughput_by_cell_reference(t_wall: np.ndarray, total_s: np.ndarray, tokens: np.ndarray,
                                 positions: np.ndarray | None, cells: np.ndarray | None,
                                 ncell: int) -> list[dict[str, Any]]:
    """``throughput_by_cell`` cell by cell: each cell's rows gathered, then ``throughput_of``."""
    return [_cell_throughput(t_wall, total_s, tokens, positions, cells, c) for c in range(ncell)]


def _cell_throughput(t_wall: np.ndarray, total_s: np.ndarray, tokens: np.ndarray, positions: np.ndarray | None,
                     cells: np.ndarray | None, c: int) -> dict[str, Any]:
    rows = _rows(len(t_wall), positions)
    at = rows[_in_cell(cells, len(rows), c, None)]
    return throughput_of(t_wall[at], total_s[at], tokens[at])


def buckets(values: np.ndarray, positions: np.ndarray | None, edges: tuple[float, ...], *,
            inclusive: bool) -> np.ndarray:
    """Each row's bucket (int8): how many ``edges`` its value is above (``inclusive``: at or above), -1 where
    it is not a finite number; the rows are ``positions`` into ``values`` (None: every one)."""
    values = np.asarray(values, dtype=float)
    if _cellsc is None or len(edges) > 127:
        return buckets_reference(values, positions, edges, inclusive=inclusive)
    out = np.empty(len(values) if positions is None else len(positions), dtype=np.int8)
    _cellsc.buckets(values, positions, tuple(float(e) for e in edges), inclusive, out)
    return out


def buckets_reference(values: np.ndarray, positions: np.ndarray | None, edges: tuple[float, ...], *,
                      inclusive: bool) -> np.ndarray:
    """``buckets`` in numpy: the rows gathered, then one comparison pass per edge (a binary search per value
    cost 30 ns of a month's 10M values)."""
    x = np.asarray(values, dtype=float)
    if positions is not None:
        x = x[positions]
    idx = np.zeros(len(x), dtype=np.int8)  # fewer than 128 edges
    for e in edges:
        idx += (x >= e) if inclusive else (x > e)
    return np.where(np.isfinite(x), idx, np.int8(-1))


def _per_code(values: tuple, table: Mapping[Any, Any], default: Any) -> np.ndarray:
    return np.array([*(table.get(v, default) for v in values), table.get(None, default)])


def text_cells(turns: Turns, name: str, table: Mapping[Any, int], default: int = -1) -> np.ndarray:
    """``turns.lookup(name, table, default)`` for a table of cell numbers: each turn's cell from its value of
    text column ``name``. The C path reads the column's codes through the turns' positions into int8 (a
    table of fewer than 128 cells), where the lookup gathers the codes first."""
    codes, positions, values = turns.code_source(name)
    per_code = _per_code(values, table, default)
    if _cellsc is None or not len(per_code) or per_code.min() < -128 or per_code.max() > 127:
        return turns.lookup(name, table, default)
    out = np.empty(len(turns), dtype=np.int8)
    _cellsc.code_cells(codes, positions, per_code.astype(np.int8), out)
    return out


def text_values(turns: Turns, name: str) -> set:
    """``turns.distinct(name)``: the values text column ``name`` holds in these turns (None for NULL), the
    C path reading the codes through the turns' positions."""
    if _cellsc is None:
        return turns.distinct(name)
    codes, positions, values = turns.code_source(name)
    seen = _cellsc.codes_present(codes, positions, len(values))
    return {values[c] for c in range(len(values)) if seen[c]} | ({None} if seen[len(values)] else set())
