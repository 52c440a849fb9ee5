"""store/pages.py: a mapped column's resident pages leave the process when released, and reading it
again gives the same values. Resident pages are read from /proc/self/smaps, the mapping of that file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specproxy.store.pages import map_column, release
from specproxy.store.turns import Turns

ROWS = 1 << 20  # 8 MiB of float64


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            mine = fields[-1] == str(path)
        elif mine and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.fixture
def column(tmp_path):
    values = np.random.default_rng(1).lognormal(0, 1, ROWS)
    path = tmp_path / "col.bin"
    path.write_bytes(values.tobytes())
    with open(path, "rb") as f:
        mapped = map_column(f, ROWS, np.dtype(np.float64), 0)
    return path, values, mapped


def test_a_released_column_leaves_the_process_and_reads_the_same_again(column):
    path, values, mapped = column
    assert float(mapped.sum()) == float(values.sum())  # every page touched
    assert _resident_kib(path) >= ROWS * 8 // 1024 * 0.9
    release(mapped)
    assert _resident_kib(path) == 0
    assert np.array_equal(mapped, values)  # read back from the page cache
    assert _resident_kib(path) >= ROWS * 8 // 1024 * 0.9


def test_releasing_an_array_that_is_not_mapped_does_nothing():
    x = np.arange(10.0)
    release(x)
    release(x[2:])
    assert x.tolist() == list(range(10))


def test_a_selection_gives_back_the_pages_it_copied_from_and_load_passes_too(column):
    path, values, mapped = column
    turns = Turns({"t_wall": mapped, "x": mapped})
    some = turns.select(values > 1.0)
    got = some.num["x"]  # a copy of the selected rows: the mapped pages are not needed for it
    assert np.array_equal(got, values[values > 1.0])
    assert _resident_kib(path) == 0
    assert float(turns.num["t_wall"].sum()) == float(values.sum())  # the whole column, read in place
    assert _resident_kib(path) > 0
    turns.release_pages()
    assert _resident_kib(path) == 0
