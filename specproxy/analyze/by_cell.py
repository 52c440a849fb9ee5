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

from typing import Any

import numpy as np

from specproxy.store.dataset import busy_seconds

try:
    from specproxy.analyze import _cellsc
except ImportError:  # no compiler at install: cell by cell, in numpy
    _cellsc = None

__all__ = ["NATIVE", "finite_by_cell", "finite_by_cell_reference", "throughput_by_cell",
           "throughput_by_cell_reference", "throughput_of"]

NATIVE = _cellsc is not None


def _rows(n: int, positions: np.ndarray | None) -> np.ndarray:
    return np.arange(n) if positions is None else positions


def _in_cell(cells: np.ndarray | None, count: int, c: int, mask: np.ndarray | None) -> np.ndarray:
    """Which of ``count`` rows are in cell ``c`` and count (``mask``)."""
    mine = np.full(count, c == 0) if cells is None else (cells == c)
    return mine if mask is None else mine & mask


def finite_by_cell(values: np.ndarray, positions: np.ndarray | None, cells: np.ndarray | None, ncell: int,
                   mask: np.ndarray | None = None) -> list[np.ndarray]:
    """Per cell ``0..ncell-1``, the finite ``values`` at its rows, in row order: the rows are ``positions``
    into ``values`` (None: every one), ``cells`` says each row's cell (-1: none; None: every row in cell 0),
    ``mask`` which rows count (None: all). The C path returns views into one buffer."""
    if _cellsc is None or values.dtype != np.float64:
        return finite_by_cell_reference(values, positions, cells, ncell, mask)
    x, starts, counts = _cellsc.finite_by_cell(values, positions, cells, ncell, mask, np.empty)
    return [x[s:s + n] for s, n in zip(starts, counts)]


def finite_by_cell_reference(values: np.ndarray, positions: np.ndarray | None, cells: np.ndarray | None,
                             ncell: int, mask: np.ndarray | None = None) -> list[np.ndarray]:
    """``finite_by_cell`` cell by cell: the cell's rows selected, its values gathered, the finite kept."""
    rows = _rows(len(values), positions)
    out = []
    for c in range(ncell):
        v = values[rows[_in_cell(cells, len(rows), c, mask)]]
        out.append(v[np.isfinite(v)])
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
