"""``Turns`` (store/turns.py) held to plain numpy on object arrays: text kept as codes answers every
question as the objects do (NULL apart from every value, the string "None" included), and selections,
chained or not, give exactly the rows eager masks give, while copying a column only when it is read."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.store.turns import NULL, Turns, factorize

VALUES = ("ok", "error", "None", "", None)


def _columns(rng: np.random.Generator, n: int) -> tuple[dict, dict, dict]:
    """Numbers, text as objects, and the same text as codes into values some of which no row holds."""
    num = {"t_wall": np.arange(n, dtype=float), "x": rng.normal(size=n)}
    txt = {"outcome": np.array([VALUES[i] for i in rng.integers(0, len(VALUES), n)], dtype=object)}
    values = ("absent", *(v for v in VALUES if v is not None))  # "absent": a value no row holds
    codes = np.array([NULL if v is None else values.index(v) for v in txt["outcome"].tolist()], dtype=np.int32)
    return num, txt, {"outcome": (codes, values)}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40), coded=st.booleans())
def test_codes_answer_as_the_objects_do(seed: int, n: int, coded: bool) -> None:
    rng = np.random.default_rng(seed)
    num, txt, codes = _columns(rng, n)
    t = Turns(num, codes=codes) if coded else Turns(num, txt)
    objects = txt["outcome"]
    assert len(t) == n and t.txt["outcome"].tolist() == objects.tolist()
    for value in VALUES + ("absent", "nowhere"):
        assert t.is_("outcome", value).tolist() == [v == value for v in objects.tolist()]
    assert t.ok.tolist() == (objects == "ok").tolist()
    assert t.distinct("outcome") == set(objects.tolist())
    assert list(t.counts("outcome").items()) == list(Counter(objects.tolist()).items())  # first-seen order too
    table = {"ok": 0, "None": 1, None: 2}
    assert t.lookup("outcome", table, default=-5).tolist() == [table.get(v, -5) for v in objects.tolist()]
    c, values = t.codes("outcome")
    assert [None if k == NULL else values[k] for k in c.tolist()] == objects.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40), coded=st.booleans(), by_position=st.booleans())
def test_a_selection_of_a_selection_is_the_rows_eager_masks_give(seed: int, n: int, coded: bool,
                                                                 by_position: bool) -> None:
    rng = np.random.default_rng(seed)
    num, txt, codes = _columns(rng, n)
    t = Turns(num, codes=codes) if coded else Turns(num, txt)
    m1 = rng.random(n) < 0.6
    first = t.select(np.flatnonzero(m1) if by_position else m1)
    m2 = rng.random(len(first)) < 0.6
    second = first.select(m2, columns=("x", "outcome"))
    assert set(second.num) == {"x"} and set(second.txt) == {"outcome"} and len(second) == int(m2.sum())
    assert np.array_equal(second.num["x"], num["x"][m1][m2])
    assert second.txt["outcome"].tolist() == txt["outcome"][m1][m2].tolist()
    assert second.distinct("outcome") == set(txt["outcome"][m1][m2].tolist())
    assert np.array_equal(first.num["t_wall"], num["t_wall"][m1])


def test_select_copies_nothing_until_a_column_is_read() -> None:
    x = np.arange(6, dtype=float)
    t = Turns({"t_wall": x.copy(), "x": x})
    some = t.select(x >= 2)
    x[:] = -x  # the loaded column changes after the selection: the selection has not copied it yet
    assert some.num["x"].tolist() == [-2.0, -3.0, -4.0, -5.0]
    held = some.num["x"]
    x[:] = 7.0  # what was read is a copy: later edits of the loaded column do not reach it
    assert held.tolist() == [-2.0, -3.0, -4.0, -5.0]
    assert some.num["x"] is held  # read again while a reader holds it: the same copy, not another
    del held
    assert some.num["x"].tolist() == [7.0] * 4  # let go of by every reader, it is copied again when read


def test_columns_assigned_to_a_selection_are_its_own_and_select_with_it() -> None:
    t = Turns({"t_wall": np.arange(5, dtype=float)}, {"outcome": np.array(["ok", None, "ok", "x", None], object)})
    ok = t.select(t.ok)
    ok.num["y"] = np.array([10.0, 30.0])
    ok.txt["outcome"] = np.array(["a", "b"], dtype=object)
    later = ok.select(np.array([False, True]))
    assert later.num["y"].tolist() == [30.0] and later.txt["outcome"].tolist() == ["b"]
    assert later.codes("outcome")[0].tolist() == [1] and t.txt["outcome"][1] is None


def test_factorize_keeps_first_seen_order_and_null_apart() -> None:
    codes, values = factorize(["b", None, "a", "b", "None"])
    assert codes.tolist() == [0, NULL, 1, 0, 2] and values == ("b", "a", "None")
