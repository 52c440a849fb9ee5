"""Columns mapped read-only from files, and their resident pages given back once copied from.

Why: a mapped column's pages count in the process's resident memory once touched, and a month's report
touches every column: 1.7 GB of a 10M-turn report's 3.4 GB peak were pages of mapped columns, most of
them already copied from (the figures read the selected turns' copies, ``turns.py``). Released with
``madvise(MADV_DONTNEED)``, which on a read-only shared mapping only unmaps them, they leave the process;
the file's pages stay in the kernel's page cache, so touching one again is a minor fault, not a read.
The files are never written once made (``column_cache.py``), so what is read back is what was there.
"""

from __future__ import annotations

import mmap
from typing import BinaryIO

import numpy as np

__all__ = ["map_column", "release"]

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # not on every platform: then pages stay mapped


def map_column(f: BinaryIO, rows: int, dtype: np.dtype, offset: int) -> np.ndarray:
    """``rows`` values of ``dtype`` at ``offset`` of the open file, mapped read-only (no copy)."""
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=dtype, count=rows, offset=offset)


def release(column: np.ndarray) -> None:
    """Give back the resident pages of a column made by ``map_column`` (anything else: nothing)."""
    view = column.base
    mapped = getattr(view, "obj", None)  # frombuffer's base: a memoryview of the mmap
    if _DONTNEED is not None and isinstance(mapped, mmap.mmap) and not mapped.closed:
        mapped.madvise(_DONTNEED)
