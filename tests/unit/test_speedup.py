"""Tests for specproxy.analyze.speedup: a worked example's numbers, both forms, the inverse, the edges."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from specproxy.analyze.speedup import (
    DEFAULT_SPEEDUPS, required_decode_speedup, ttft_share, whole_turn_speedup, window_speedups,
)

# A worked example (the turn in speedup.py's docstring): 377 tokens in 10.003 s of decode after
# 6.084 s to the first token (16.087 s).
TTFT, DECODE = 6.084, 10.003


@pytest.mark.parametrize("s, felt", [(1.11, 1.07), (1.42, 1.26), (2.58, 1.98)])
def test_field_note_after_form(s, felt):
    assert round(whole_turn_speedup(TTFT, DECODE, s, measured="after"), 2) == felt


def test_field_note_share_and_ceiling():
    assert ttft_share(TTFT, DECODE) == pytest.approx(6.084 / 16.087)
    # nothing faster than 16.087 / 6.084 = 2.64x can be felt, however fast decode gets
    assert whole_turn_speedup(TTFT, DECODE, 1e12) == pytest.approx(16.087 / 6.084)


def test_before_form_on_its_own_numbers():
    # 2 s to first token, 8 s of decode; decode twice as fast -> 10 s become 6 s
    assert whole_turn_speedup(2.0, 8.0, 2.0) == pytest.approx(10.0 / 6.0)
    assert whole_turn_speedup(2.0, 8.0, 2.0, measured="before") == pytest.approx(5.0 / 3.0)
    assert whole_turn_speedup(0.0, 8.0, 3.0) == pytest.approx(3.0)   # no TTFT: all of it
    assert whole_turn_speedup(5.0, 0.0, 3.0) == pytest.approx(1.0)   # no decode: none of it
    assert whole_turn_speedup(2.0, 8.0, 0.5) == pytest.approx(10.0 / 18.0)  # a slowdown


def test_forms_agree_when_the_times_are_the_same_turn():
    # before the 1.11x change the note's decode took 10.003 * 1.11 s
    before = whole_turn_speedup(TTFT, DECODE * 1.11, 1.11, measured="before")
    assert before == pytest.approx(whole_turn_speedup(TTFT, DECODE, 1.11, measured="after"))


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.floats(0, 100), st.floats(0.01, 100), st.floats(0.05, 20))
def test_forms_agree_and_inverse_roundtrips(t, d, s):
    before = whole_turn_speedup(t, d * s, s, measured="before")
    assert before == pytest.approx(whole_turn_speedup(t, d, s, measured="after"), rel=1e-9)
    felt = whole_turn_speedup(t, d, s)
    back = required_decode_speedup(t, d, felt)
    if back is not None:  # None only when felt sits at the ceiling to rounding
        assert back == pytest.approx(s, rel=1e-6)
    assert min(1.0, s) - 1e-12 <= felt <= max(1.0, s) + 1e-12  # diluted, never amplified


def test_required_decode_speedup():
    # 2 s TTFT + 8 s decode: for 1.25x the turn must take 8 s, so decode 6 s: s = 4/3
    assert required_decode_speedup(2.0, 8.0, 1.25) == pytest.approx(4.0 / 3.0)
    assert required_decode_speedup(2.0, 8.0, 1.0) == pytest.approx(1.0)
    s = required_decode_speedup(TTFT, DECODE, 1.5)
    assert whole_turn_speedup(TTFT, DECODE, s) == pytest.approx(1.5)
    assert required_decode_speedup(0.0, 8.0, 10.0) == pytest.approx(10.0)


def test_required_decode_speedup_unreachable():
    ceiling = (TTFT + DECODE) / TTFT  # 2.644...
    assert required_decode_speedup(TTFT, DECODE, ceiling) is None
    assert required_decode_speedup(TTFT, DECODE, 3.0) is None
    assert required_decode_speedup(TTFT, DECODE, ceiling * 0.999) > 100
    assert required_decode_speedup(5.0, 0.0, 1.2) is None
    assert required_decode_speedup(5.0, 0.0, 1.0) == 1.0


@pytest.mark.parametrize("args", [(-1.0, 1.0, 2.0), (1.0, -0.1, 2.0), (1.0, 1.0, 0.0),
                                  (1.0, 1.0, -2.0), (0.0, 0.0, 2.0), (math.nan, 1.0, 2.0),
                                  (1.0, math.inf, 2.0), (1.0, 1.0, math.inf)])
def test_invalid_inputs_raise(args):
    with pytest.raises(ValueError):
        whole_turn_speedup(*args)


def test_invalid_form_and_target_raise():
    with pytest.raises(ValueError, match="measured"):
        whole_turn_speedup(1.0, 1.0, 2.0, measured="later")
    with pytest.raises(ValueError):
        required_decode_speedup(1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        ttft_share(0.0, 0.0)


def test_window_uses_sums_over_turns():
    w = window_speedups([1.0, 3.0, None, 2.0], [4.0, 6.0, 5.0, float("nan")])
    assert w.n == 2 and (w.ttft_s, w.decode_s) == (4.0, 10.0)  # incomplete turns dropped whole
    assert w.ttft_share == pytest.approx(4.0 / 14.0)
    assert w.max_speedup == pytest.approx(14.0 / 4.0)
    assert set(w.speedups) == set(DEFAULT_SPEEDUPS)
    assert w.speedups[2.0] == pytest.approx(14.0 / 9.0)
    # the sum form is the ratio of total turn time: same as summing per-turn times
    per_turn = sum(t + d for t, d in [(1, 4), (3, 6)]) / sum(t + d / 3 for t, d in [(1, 4), (3, 6)])
    assert w.speedups[3.0] == pytest.approx(per_turn)
    assert window_speedups([TTFT], [DECODE], measured="after").speedups[1.5] == pytest.approx(
        whole_turn_speedup(TTFT, DECODE, 1.5, measured="after"))
    w.to_dict()


def test_window_without_data():
    w = window_speedups([], [])
    assert w.n == 0 and w.ttft_share is None and all(v is None for v in w.speedups.values())
    with pytest.raises(ValueError):
        window_speedups([1.0, 2.0], [1.0])
