"""The numbers behind the pictures (``analyze/pictures.py``) on inputs small enough to work out by hand:
the histograms' bins, the operating point's counts, the throughput timeline's slots and the whole-turn
speedup curve, with the edge cases (nothing, one value, all values equal, missing values)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specproxy.analyze.pictures import SPEEDUP_GRID, histogram, pictures
from specproxy.store.dataset import NUMERIC, Turns

NAN = float("nan")


def turns(rows: list[dict]) -> Turns:
    """Turns from rows of the columns that matter here: unset numbers are NaN, outcome "ok", streamed, started at 0."""
    default = {"streamed": 1.0, "t_wall": 0.0}
    num = {k: np.array([float(r.get(k, default.get(k, NAN))) for r in rows]) for k in NUMERIC}
    txt = {"outcome": np.array([r.get("outcome", "ok") for r in rows], dtype=object)}
    return Turns(num, txt)


def test_histogram_bins_exactly_from_min_to_max_the_last_bin_closed():
    h = histogram(np.array([0.0, 1.0, 2.0, 3.0, 3.0]), bins=3)
    assert h == {"n": 5, "edges": [0.0, 1.0, 2.0, 3.0], "counts": [1, 1, 3]}


def test_histogram_leaves_out_missing_and_infinite_values():
    h = histogram(np.array([NAN, 1.0, math.inf, 2.0, -math.inf]), bins=2)
    assert h == {"n": 2, "edges": [1.0, 1.5, 2.0], "counts": [1, 1]}


def test_histogram_of_nothing_has_no_bins():
    assert histogram(np.array([])) == {"n": 0, "edges": [], "counts": []}
    assert histogram(np.array([NAN, NAN])) == {"n": 0, "edges": [], "counts": []}


@pytest.mark.parametrize("values, lo, hi", [([5.0], 5.0, 5.05), ([2.0, 2.0, 2.0], 2.0, 2.02), ([0.0, 0.0], 0.0, 1.0),
                                            ([-4.0], -4.0, -3.96)])
def test_histogram_of_one_value_or_equal_values_is_one_bar_in_the_first_bin(values, lo, hi):
    h = histogram(np.array(values), bins=4)
    assert h["n"] == len(values) and h["counts"] == [len(values), 0, 0, 0]
    assert h["edges"][0] == lo and h["edges"][-1] == pytest.approx(hi) and len(h["edges"]) == 5


def test_operating_point_counts_completed_turns_per_level():
    t = turns([{"concurrency": 1}, {"concurrency": 1}, {"concurrency": 3}, {"concurrency": 3, "outcome": "client_abort"},
               {"concurrency": NAN}, {"concurrency": 2, "streamed": 0}])
    assert pictures(t)["concurrency"] == {"n": 4, "values": [1, 2, 3], "counts": [2, 1, 1]}


def test_timeline_files_each_turn_under_the_slot_it_started_in():
    # slots of 5 s from the first start (0) to the last (10): [0, 5) and [5, 10]
    t = turns([
        {"t_wall": 0.0, "total_s": 2.0, "completion_tokens": 10, "decode_tps": 30.0},
        {"t_wall": 1.0, "total_s": 2.0, "completion_tokens": 20, "decode_tps": 10.0},
        {"t_wall": 2.0, "total_s": 1.0, "completion_tokens": 30, "decode_tps": 99.0, "streamed": 0},
        {"t_wall": 3.0, "total_s": 9.0, "completion_tokens": 500, "decode_tps": 1.0, "outcome": "upstream_error"},
        {"t_wall": 4.9, "total_s": 6.0, "completion_tokens": 30, "decode_tps": 20.0},  # runs into the next slot
        {"t_wall": 10.0, "total_s": 4.0, "completion_tokens": 8, "decode_tps": 5.0},
    ])
    rows = pictures(t, slots=2)["timeline"]
    # slot 0: busy [0, 3] and [4.9, 10.9] = 9 s, 90 tokens; per stream the median of 30, 10, 20 (the
    # non-streamed turn is in the aggregate only; the failed one in neither)
    assert rows == [{"slot": 0, "t_wall": 2.5, "per_stream_tps": 20.0, "aggregate_tps": pytest.approx(90 / 9.0), "n": 4},
                    {"slot": 1, "t_wall": 7.5, "per_stream_tps": 5.0, "aggregate_tps": 2.0, "n": 1}]


def test_timeline_skips_empty_slots_and_takes_turns_that_all_started_at_once_as_one_slot():
    t = turns([{"t_wall": 0.0, "total_s": 1.0, "completion_tokens": 4, "decode_tps": 8.0},
               {"t_wall": 9.9, "total_s": 1.0, "completion_tokens": 6, "decode_tps": 6.0}])
    assert [r["t_wall"] for r in pictures(t, slots=3)["timeline"]] == pytest.approx([1.65, 8.25])
    same = turns([{"t_wall": 7.0, "total_s": 2.0, "completion_tokens": 4, "decode_tps": 8.0},
                  {"t_wall": 7.0, "total_s": 1.0, "completion_tokens": 6, "decode_tps": 6.0}])
    (row,) = pictures(same)["timeline"]
    assert row["n"] == 2 and row["aggregate_tps"] == 5.0 and row["per_stream_tps"] == 7.0


def test_speedup_curve_from_the_summed_times_with_its_ceiling():
    # summed TTFT 2 s, decode 4 s: s times faster decode gives 6 / (2 + 4 / s); the ceiling is 6 / 2
    t = turns([{"ttft_s": 1.0, "decode_s": 1.0}, {"ttft_s": 1.0, "decode_s": 3.0},
               {"ttft_s": 50.0, "decode_s": 1.0, "streamed": 0}, {"ttft_s": 50.0, "decode_s": 1.0, "outcome": "x"}])
    curve = pictures(t)["speedup_curve"]
    assert curve["n"] == 2 and curve["max_speedup"] == 3.0
    assert [s for s, _ in curve["points"]] == list(SPEEDUP_GRID)
    for s, v in curve["points"]:
        assert v == pytest.approx(6.0 / (2.0 + 4.0 / s))


def test_pictures_of_no_turns_are_empty_not_errors():
    p = pictures(turns([]))
    assert p["timeline"] == [] and p["concurrency"] == {"n": 0, "values": [], "counts": []}
    assert all(d["n"] == 0 for d in p["distributions"].values())
    assert p["speedup_curve"]["max_speedup"] is None and all(v is None for _, v in p["speedup_curve"]["points"])


def test_distributions_are_over_completed_streamed_turns_only():
    t = turns([{"ttft_s": 0.1, "tokens_per_chunk": 2.0}, {"ttft_s": 0.3, "tokens_per_chunk": 2.0},
               {"ttft_s": 9.0, "tokens_per_chunk": 40.0, "streamed": 0}, {"ttft_s": 7.0, "outcome": "client_abort"}])
    d = pictures(t)["distributions"]
    assert d["ttft_s"]["n"] == 2 and d["ttft_s"]["edges"][0] == 0.1 and d["ttft_s"]["edges"][-1] == 0.3
    assert d["tokens_per_chunk"]["counts"][0] == 2 and d["decode_tps"]["n"] == 0

