"""specproxy.store._columnsc, SQLite rows into column buffers in C, held to the plain reader.

``column_reader.read_reference`` (the sqlite3 module, a Python object per value) is the reference:
for any rows of numbers, NULLs and text the C reader returns the same arrays, bit for bit, and the
same dictionaries in the same order. What it cannot read as asked it refuses (``Unsupported``), so
the caller reads with the reference instead; it never guesses.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.store import column_reader
from specproxy.store.column_reader import Unsupported, read_native, read_reference

pytestmark = pytest.mark.skipif(not column_reader.NATIVE, reason="specproxy.store._columnsc is not built")


def test_columnsc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1 (it requires every C module): a silent fallback fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert column_reader.NATIVE


def _db(path: Path, rows: list[tuple]) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (n REAL, k INTEGER, s TEXT, u TEXT)")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
    conn.execute("CREATE TABLE edits (n INTEGER)")
    conn.execute("INSERT INTO edits VALUES (7)")
    conn.commit()
    conn.close()
    return path


SQL = "SELECT rowid, n, k, s, u FROM t WHERE rowid > ? ORDER BY rowid"
KINDS = "ifftt"


def _same(path: Path, sql: str = SQL, params: tuple = (0,), kinds: str = KINDS) -> None:
    _, (arrays, dicts) = read_native(path, sql, params, kinds)
    conn = sqlite3.connect(path)
    ref_arrays, ref_dicts = read_reference(conn, sql, params, kinds)
    conn.close()
    assert dicts == ref_dicts
    for a, b in zip(arrays, ref_arrays, strict=True):
        assert a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()  # bit for bit: NaN for NULL, the same rounding of big integers


texts = st.one_of(st.none(), st.sampled_from(["ok", "client_abort", "", "é", "ok\x00x"]), st.text(max_size=8))
numbers = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-(2**63), 2**63 - 1))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(numbers, st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), texts, texts),
                     max_size=40))
def test_the_c_reader_returns_what_the_reference_reads(tmp_path_factory, rows):
    path = _db(tmp_path_factory.mktemp("cr") / "t.db", rows)
    _same(path)


def test_many_rows_grow_every_buffer_and_dictionary(tmp_path):
    rng = np.random.default_rng(3)
    n = 70_000  # past the first buffer (64 KiB) and many dictionary growths
    rows = [(None if i % 11 == 0 else float(x), int(i), f"s{i % 5000}", None if i % 3 else "u")
            for i, x in enumerate(rng.random(n).tolist())]
    path = _db(tmp_path / "t.db", rows)
    _same(path)
    _, (arrays, dicts) = read_native(path, SQL, (0,), KINDS)
    assert len(arrays[0]) == n and len(dicts[3]) == 5000 and dicts[4] == ["u"]


def test_the_guard_is_read_in_the_same_transaction_and_params_bind(tmp_path):
    path = _db(tmp_path / "t.db", [(1.5, 1, "a", "b"), (2.5, 2, "c", None), (3.5, 3, "a", None)])
    guard, (arrays, dicts) = read_native(path, SQL, (1,), KINDS, "SELECT n FROM edits")
    assert guard == 7
    assert arrays[0].tolist() == [2, 3] and arrays[1].tolist() == [2.5, 3.5]
    assert arrays[3].tolist() == [0, 1] and dicts[3] == ["c", "a"]
    assert arrays[4].tolist() == [-1, -1] and dicts[4] == []
    assert read_native(path, SQL, (1,), KINDS, "SELECT n FROM edits WHERE 0")[0] is None
    _, (empty, _) = read_native(path, SQL, (99,), KINDS)
    assert [a.dtype for a in empty] == [np.int64, np.float64, np.float64, np.int32, np.int32]
    assert all(len(a) == 0 for a in empty)


@pytest.mark.parametrize("row, kinds", [
    (("text", 1, "a", "b"), KINDS),  # text in a float column
    ((1.0, 1, b"\x00", "b"), KINDS),  # a blob in a text column
    ((1.0, None, "a", "b"), "ifitt"),  # NULL in an int64 column
])
def test_a_value_it_cannot_read_as_asked_is_refused_not_guessed(tmp_path, row, kinds):
    path = _db(tmp_path / "t.db", [row])
    with pytest.raises(Unsupported):
        read_native(path, SQL, (0,), kinds)


def test_sqlite_errors_are_errors(tmp_path):
    path = _db(tmp_path / "t.db", [])
    with pytest.raises(RuntimeError, match="no such table"):
        read_native(path, "SELECT x FROM nowhere", (), "f")
    with pytest.raises(RuntimeError, match="no such table"):
        read_native(path, SQL, (0,), KINDS, "SELECT n FROM nowhere")
    with pytest.raises(ValueError, match="one letter per result column"):
        read_native(path, SQL, (0,), "if")
    with pytest.raises(RuntimeError, match="cannot open"):
        read_native(tmp_path / "missing.db", SQL, (0,), KINDS)
