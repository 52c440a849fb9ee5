"""``Turns``: a window's turns as columns, with text kept as codes and selections that copy nothing up front.

Why codes: a text column of a million turns holds a handful of distinct values (outcomes, labels,
instances). As Python objects, every comparison, set and group over it walks a million objects (the
report's per-instance table spent ~1 s so); as int32 codes into a short list of values it is one numpy
pass. The column cache already stores text that way, so the loader hands the codes over as they are.
``txt[name]`` still gives the object array (decoded on first use and kept), so every reader of it works;
the hot paths ask ``codes``, ``is_``, ``lookup``, ``distinct`` or ``counts`` instead. NULL is code -1,
distinct from every value.

Why lazy selections: ``select`` used to copy every (or every named) column of the selected turns, most of
which were never read (0.4 s at 1M turns, seconds and gigabytes at 10M). A selection now holds its
parent's whole columns and the selected positions, and copies a column the first time it is read (then
keeps it); a selection of a selection composes the positions, so it still reads from the loaded columns.
"""

from __future__ import annotations

import weakref

from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from specproxy.store.pages import release

__all__ = ["NULL", "Turns", "decode", "factorize", "first_seen"]

NULL = -1  # the code of NULL (None) in every text column


def factorize(objects: Iterable[Any]) -> tuple[np.ndarray, tuple]:
    """Objects as int32 codes into their distinct values in first-seen order; None is ``NULL``."""
    table: dict[Any, int] = {}
    codes = np.fromiter((NULL if v is None else table.setdefault(v, len(table)) for v in objects), dtype=np.int32)
    return codes, tuple(table)


def first_seen(codes: np.ndarray, present: np.ndarray) -> np.ndarray:
    """``present`` (the distinct values of ``codes``, ascending) in the order they first occur in ``codes``:
    a pass per value when there are few (outcomes, labels, instances), one ``numpy.unique`` when many."""
    if len(present) <= 64:
        first = np.array([int(np.argmax(codes == c)) for c in present.tolist()], dtype=np.int64)
    else:
        _, first = np.unique(codes, return_index=True)
    return present[np.argsort(first, kind="stable")]


def decode(codes: np.ndarray, values: Sequence[Any]) -> np.ndarray:
    """Codes back into an object array of their values (``NULL`` is None)."""
    return np.array([*values, None], dtype=object)[codes]  # code -1 (NULL) is the last entry


class _Column:
    """One column as loaded, every row of it: numbers (``data``), or text as codes (``data``, int32) into
    ``values``, or text as an object array (``objects``; its codes are made from it once, when asked)."""

    __slots__ = ("data", "values", "objects")

    def __init__(self, data: np.ndarray | None, values: tuple | None = None, objects: np.ndarray | None = None):
        self.data, self.values, self.objects = data, values, objects

    def __len__(self) -> int:
        return len(self.data if self.data is not None else self.objects)

    def codes(self) -> tuple[np.ndarray, tuple]:
        if self.data is None:
            self.data, self.values = factorize(self.objects.tolist())
        return self.data, self.values


def _positions(mask: Any, n: int) -> np.ndarray:
    """A boolean mask, positions or a slice as ascending-as-given int64 positions."""
    if isinstance(mask, slice):
        return np.arange(n)[mask]
    mask = np.asarray(mask)
    if mask.dtype == bool:
        if mask.shape != (n,):
            raise IndexError(f"boolean mask of {mask.shape} over {n} turns")
        return np.flatnonzero(mask)
    return mask.astype(np.int64, copy=False)


class _View(MutableMapping):
    """``Turns.num`` or ``Turns.txt``: a mapping from column name to its array, made on first access."""

    __slots__ = ("_turns", "_text")

    def __init__(self, turns: Turns, text: bool):
        self._turns, self._text = turns, text

    def _cols(self) -> dict[str, tuple[_Column, np.ndarray | None]]:
        return self._turns._txt if self._text else self._turns._num

    def __getitem__(self, name: str) -> np.ndarray:
        return self._turns._text(name) if self._text else self._turns._number(name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        self._forget(name)
        self._cols()[name] = (_Column(None, objects=value) if self._text else _Column(value), None)

    def __delitem__(self, name: str) -> None:
        del self._cols()[name]
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._turns._made[self._text].pop(name, None)
        if self._text:
            self._turns._codes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._cols()

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols())

    def __len__(self) -> int:
        return len(self._cols())

    def __repr__(self) -> str:
        return f"<{'txt' if self._text else 'num'} columns {list(self._cols())}>"


class Turns:
    """Columns of the selected turns: ``num[name]`` float arrays (``num["rowid"]`` int64), ``txt[name]``
    object arrays (None for NULL); both mappings are filled on first access of each column.

    ``Turns(num, txt)`` takes arrays as they are; ``codes`` (name -> (int32 codes, values)) text as codes;
    ``positions`` (int64) makes these the rows at those positions of the given columns, copied when read.

    A selection's numeric copy is kept only while something else holds it (a weak reference): read
    again later, it is copied again. Kept for the report's whole life, a month's selected copies of every
    column (the completed turns', the streamed turns') were 1 GB of its 3 GB of private memory at 10M
    turns; a column is mostly read by one figure, or by several at once, and a copy is 40-80 ms.
    """

    __slots__ = ("_num", "_txt", "_n", "_made", "_codes")

    def __init__(self, num: Mapping[str, np.ndarray], txt: Mapping[str, np.ndarray] | None = None, *,
                 codes: Mapping[str, tuple[np.ndarray, Sequence]] | None = None,
                 positions: np.ndarray | None = None):
        self._num = {k: (_Column(np.asarray(v)), positions) for k, v in num.items()}
        self._txt = {k: (_Column(None, objects=np.asarray(v, dtype=object)), positions) for k, v in (txt or {}).items()}
        self._txt.update({k: (_Column(np.asarray(c, dtype=np.int32), tuple(v)), positions)
                          for k, (c, v) in (codes or {}).items()})
        if positions is not None:
            self._n = len(positions)
        else:  # t_wall is always loaded (as len() was its length); else any column
            first = self._num.get("t_wall") or next(iter((*self._num.values(), *self._txt.values())), None)
            self._n = 0 if first is None else len(first[0])
        self._made: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})  # columns read: num, txt
        self._codes: dict[str, np.ndarray] = {}  # text columns' codes read

    def __len__(self) -> int:
        return self._n

    # views made on each access, not kept: a kept view would be a reference cycle, and a window's columns
    # would then wait for the garbage collector instead of going with their last reference
    @property
    def num(self) -> _View:
        return _View(self, False)

    @property
    def txt(self) -> _View:
        return _View(self, True)

    def __repr__(self) -> str:
        return f"<Turns {self._n}: {list(self._num)} {list(self._txt)}>"

    # --- columns ---------------------------------------------------------------------------------------

    def _number(self, name: str) -> np.ndarray:
        made = self._made[0].get(name)
        got = None if made is None else made()
        if got is None:
            col, pos = self._num[name]
            if pos is None:
                got = col.data
                self._made[0][name] = lambda: got
            else:
                got = col.data[pos]
                release(col.data)  # copied from: a mapped column's pages leave the process (pages.py)
                self._made[0][name] = weakref.ref(got)
        return got

    def source(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Numeric column ``name`` as loaded and these turns' positions into it (None: every row), for a pass
        that reads through the positions rather than a copy (``analyze/by_cell``); ``release(name)`` after."""
        col, pos = self._num[name]
        return col.data, pos

    def code_source(self, name: str) -> tuple[np.ndarray, np.ndarray | None, tuple]:
        """Text column ``name`` as loaded (int32 codes, NULL -1), these turns' positions into it (None: every
        row) and its values, for a pass that reads the codes through the positions (``analyze/by_cell``)."""
        col, pos = self._txt[name]
        data, values = col.codes()
        return data, pos, values

    def release(self, name: str) -> None:
        """Give back the resident pages of the mapped column ``name`` was read from (``pages.release``)."""
        release(self._num[name][0].data)

    def release_pages(self) -> None:
        """Give back the resident pages of every mapped column these turns read from (``pages.release``):
        after the loader's passes over whole columns, which no figure reads in place."""
        for col, _ in (*self._num.values(), *self._txt.values()):
            if col.data is not None:
                release(col.data)

    def _text(self, name: str) -> np.ndarray:
        got = self._made[1].get(name)
        if got is None:
            col, pos = self._txt[name]
            if col.objects is not None:
                got = col.objects if pos is None else col.objects[pos]
            else:
                codes, values = self.codes(name)
                got = decode(codes, values)
            self._made[1][name] = got
        return got

    def codes(self, name: str) -> tuple[np.ndarray, tuple]:
        """A text column as int32 codes (``NULL``: -1) into its values (which may hold values no turn here has)."""
        col, pos = self._txt[name]
        data, values = col.codes()
        got = self._codes.get(name)
        if got is None:
            got = self._codes[name] = data if pos is None else data[pos]
        return got, values

    def is_(self, name: str, value: Any) -> np.ndarray:
        """Which turns have ``value`` (None: NULL) in text column ``name``: ``txt[name] == value``, from the codes."""
        codes, values = self.codes(name)
        if value is None:
            return codes == NULL
        try:
            return codes == values.index(value)
        except ValueError:
            return np.zeros(len(codes), dtype=bool)

    def lookup(self, name: str, table: Mapping[Any, Any], default: Any = -1) -> np.ndarray:
        """Per turn, ``table[value]`` of its value in text column ``name`` (NULL looks up None), ``default``
        where the table has none: how a text column becomes row indexes of a table, in one pass."""
        codes, values = self.codes(name)
        per_code = np.array([*(table.get(v, default) for v in values), table.get(None, default)])
        if per_code.dtype.kind == "i":  # row indexes: the narrowest integers that hold them
            lo, hi = int(per_code.min()), int(per_code.max())
            per_code = per_code.astype(next(t for t in (np.int8, np.int16, np.int32, np.int64)
                                            if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max))
        return per_code[codes]

    def distinct(self, name: str) -> set:
        """The values text column ``name`` holds in these turns (None when some turn's is NULL)."""
        codes, values = self.codes(name)
        present = np.zeros(len(values) + 1, dtype=bool)
        present[codes] = True  # one scatter pass; NULL (-1) marks the last slot (a count per value: 2x the time)
        return {values[c] for c in np.flatnonzero(present[:-1]).tolist()} | ({None} if present[-1] else set())

    def counts(self, name: str) -> dict[Any, int]:
        """How many turns hold each value of text column ``name``, in the order the values first occur
        (``collections.Counter`` over the objects, from the codes)."""
        codes, values = self.codes(name)
        tally = np.bincount(codes + 1, minlength=1)  # NULL (-1) counted first
        order = first_seen(codes, np.flatnonzero(tally) - 1)
        return {(None if c == NULL else values[c]): int(tally[c + 1]) for c in order.tolist()}

    @property
    def ok(self) -> np.ndarray:
        return self.is_("outcome", "ok")

    # --- selections ------------------------------------------------------------------------------------

    def select(self, mask: Any, columns: Sequence[str] | None = None) -> Turns:
        """The turns where ``mask`` holds (or at these positions); only ``columns`` of them when given.
        Nothing is copied here: each column of the result is copied from the loaded one when read."""
        idx = _positions(mask, self._n)
        composed: dict[int, np.ndarray] = {}

        def at(pos: np.ndarray | None) -> np.ndarray:
            if pos is None:
                return idx
            key = id(pos)
            if key not in composed:
                composed[key] = pos[idx]
            return composed[key]

        out = Turns.__new__(Turns)
        keep = self._num if columns is None else {k: self._num[k] for k in columns if k in self._num}
        out._num = {k: (col, at(pos)) for k, (col, pos) in keep.items()}
        keep = self._txt if columns is None else {k: self._txt[k] for k in columns if k in self._txt}
        out._txt = {k: (col, at(pos)) for k, (col, pos) in keep.items()}
        out._n, out._made, out._codes = len(idx), ({}, {}), {}
        return out
