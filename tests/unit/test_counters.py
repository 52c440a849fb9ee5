"""Counter arithmetic over scrapes (``specproxy.observe.counters``): deltas, MAL and acceptance by each
server's definition, restarts (a counter going down, a new start time), windows over a series of samples
and the operating point. Pure: samples are built here, pages are ``tests/pages.py``'s."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pages import (LLAMACPP_OLD_PAGE, UNKNOWN_PAGE,
                   VLLM_NO_SPEC_PAGE, VLLM_PAGE, llamacpp_page, sglang_page)
from specproxy.observe.counters import ScrapeSample, delta, running_distribution, window_counters
from specproxy.observe.server_metrics import Snapshot, parse_exposition


def sample(t: float, snap: Snapshot, instance_id: str = "inst-a") -> ScrapeSample:
    return ScrapeSample(t_mono=t, t_wall=1_760_000_000.0 + t, snapshot=snap, instance_id=instance_id)


# ----------------------------------------------------------------------------------------------
# Deltas, MAL and acceptance
# ----------------------------------------------------------------------------------------------


def test_delta_mal_and_acceptance_for_known_numbers() -> None:
    before = parse_exposition(llamacpp_page(predicted=1000, drafts=300, draft_tokens=900, accepted=600))
    after = parse_exposition(llamacpp_page(predicted=1580, drafts=500, draft_tokens=1500, accepted=980))
    d = delta(sample(10.0, before), sample(30.0, after))
    assert not d.restarted and d.segments == 1
    assert d.seconds == 20.0
    assert (d.generated_tokens, d.drafts, d.draft_tokens, d.accepted_tokens) == (580.0, 200.0, 600.0, 380.0)
    assert d.mal == pytest.approx(1 + 380 / 200)  # 2.9 tokens per verification pass
    assert d.mal_source == "counters"
    assert d.acceptance_rate == pytest.approx(380 / 600)
    assert d.generated_tps == pytest.approx(580 / 20)
    assert d.accepted_tps == pytest.approx(380 / 20)
    assert d.spec_emitted_tokens == 580.0  # every emitted token came from a verification pass
    assert d.to_dict()["mal"] == d.mal


def test_vllm_known_numbers_match_vllm_definitions() -> None:
    before = parse_exposition(VLLM_PAGE)
    e0 = '{engine="0",model_name="Qwen/Qwen3-32B"}'
    after = parse_exposition(
        VLLM_PAGE.replace(f"generation_tokens_total{e0} 1200.0", f"generation_tokens_total{e0} 1480.0")
        .replace(f"drafts_total{e0} 120.0", f"drafts_total{e0} 220.0")
        .replace(f"draft_tokens_total{e0} 360.0", f"draft_tokens_total{e0} 660.0")
        .replace(f"accepted_tokens_total{e0} 216.0", f"accepted_tokens_total{e0} 396.0")
    )
    d = delta(before, after, seconds=10.0)
    # vLLM's own: mean acceptance length = 1 + accepted/drafts; acceptance = accepted/draft tokens
    assert d.mal == pytest.approx(1 + 180 / 100)
    assert d.acceptance_rate == pytest.approx(180 / 300)
    assert d.generated_tokens == 280.0 and d.generated_tps == pytest.approx(28.0)
    assert dict(d.accepted_per_pos or {}) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_mal_is_exactly_one_when_spec_counters_exist_but_nothing_drafted() -> None:
    before = parse_exposition(llamacpp_page(predicted=1000, drafts=0, draft_tokens=0, accepted=0))
    after = parse_exposition(llamacpp_page(predicted=1500, drafts=0, draft_tokens=0, accepted=0))
    d = delta(before, after, seconds=5.0)
    assert d.mal == 1.0 and d.mal_source == "counters"
    assert d.acceptance_rate is None  # nothing proposed: no rate, not 0


def test_mal_is_none_for_an_idle_window() -> None:
    page = llamacpp_page(predicted=1000, drafts=0, draft_tokens=0, accepted=0)
    d = delta(parse_exposition(page), parse_exposition(page), seconds=5.0)
    assert d.generated_tokens == 0.0 and d.mal is None


def test_mal_unknown_when_llamacpp_exposes_no_spec_counters() -> None:
    d = delta(
        parse_exposition(LLAMACPP_OLD_PAGE.format(predicted=100)),
        parse_exposition(LLAMACPP_OLD_PAGE.format(predicted=400)),
        seconds=3.0,
    )
    assert d.generated_tokens == 300.0
    assert d.mal is None and d.drafts is None  # an old build may be drafting: unknown


def test_vllm_without_spec_config_has_mal_one() -> None:
    d = delta(
        parse_exposition(VLLM_NO_SPEC_PAGE.replace("{gen}", "10.0")),
        parse_exposition(VLLM_NO_SPEC_PAGE.replace("{gen}", "110.0")),
        seconds=2.0,
    )
    assert d.mal == 1.0 and d.mal_source == "no_spec_counters"


def test_sglang_mal_from_gauge() -> None:
    d = delta(parse_exposition(sglang_page(gen=100.0)), parse_exposition(sglang_page(gen=900.0)), seconds=4.0)
    assert d.mal == pytest.approx(3.0) and d.mal_source == "gauge"
    assert d.generated_tps == pytest.approx(200.0)
    assert d.acceptance_rate is None  # no counters; the gauge stays on the snapshot


def test_per_position_family_appearing_counts_from_zero() -> None:
    before = parse_exposition(llamacpp_page(drafts=0, draft_tokens=0, accepted=0, predicted=0))
    after = parse_exposition(llamacpp_page(drafts=10, draft_tokens=20, accepted=15, predicted=25, per_pos=(9, 6)))
    d = delta(before, after, seconds=1.0)
    assert dict(d.accepted_per_pos or {}) == {0: 9.0, 1: 6.0}
    assert d.mal == pytest.approx(2.5)


def test_counter_going_down_is_a_restart_with_nothing_derived() -> None:
    before = parse_exposition(llamacpp_page(predicted=5000, drafts=900, draft_tokens=2700, accepted=1800))
    after = parse_exposition(llamacpp_page(predicted=40, drafts=10, draft_tokens=30, accepted=20))
    d = delta(sample(0.0, before), sample(5.0, after))
    assert d.restarted
    assert d.seconds == 5.0
    derived = (d.mal, d.acceptance_rate, d.generated_tps, d.accepted_tps)
    for value in (d.generated_tokens, d.drafts, d.accepted_tokens, *derived):
        assert value is None


def test_start_time_change_is_a_restart_even_if_counters_grew() -> None:
    a = parse_exposition(VLLM_PAGE)
    b = parse_exposition(VLLM_PAGE.replace("seconds 1.76e+09", "seconds 1.77e+09").replace("} 1200.0", "} 9999.0"))
    assert delta(a, b).restarted


# ----------------------------------------------------------------------------------------------
# Windows and the operating point
# ----------------------------------------------------------------------------------------------


def _lc(
    t: float, predicted: int, drafts: int, accepted: int, inst: str = "inst-a", running: int = 1
) -> ScrapeSample:
    """A llama.cpp scrape at ``t`` (three draft tokens per draft)."""
    page = llamacpp_page(
        predicted=predicted, drafts=drafts, draft_tokens=3 * drafts, accepted=accepted, processing=running
    )
    snap = parse_exposition(page)
    return sample(t, snap, inst)


def test_window_uses_first_and_last_sample_inside_without_interpolation() -> None:
    samples = [_lc(0, 0, 0, 0), _lc(5, 100, 40, 60), _lc(10, 300, 100, 200), _lc(15, 330, 110, 220)]
    w = window_counters(samples, 2.0, 12.0)  # covers samples at 5 and 10 only
    assert w is not None
    assert w.seconds == 5.0 and w.generated_tokens == 200.0
    assert w.mal == pytest.approx(1 + 140 / 60)
    assert window_counters(samples, 6.0, 9.0) is None  # no sample inside
    assert window_counters(samples, 4.0, 6.0) is None  # one sample: no delta


def test_window_splits_at_restart_and_sums_instances() -> None:
    samples = [
        _lc(0, 1000, 100, 150),
        _lc(5, 1200, 150, 250),  # +200 tokens, +50 drafts, +100 accepted
        _lc(10, 30, 10, 15, inst="inst-b"),  # restart: the tokens between 5 and 10 are lost
        _lc(15, 130, 40, 75, inst="inst-b"),  # +100, +30, +60
    ]
    w = window_counters(samples, 0.0, 20.0)
    assert w is not None
    assert w.segments == 2 and not w.restarted
    assert w.seconds == 10.0
    assert w.generated_tokens == 300.0 and w.drafts == 80.0 and w.accepted_tokens == 160.0
    assert w.mal == pytest.approx(1 + 160 / 80)


def test_window_splits_where_counters_drop_even_under_one_instance_id() -> None:
    samples = [_lc(0, 500, 50, 50), _lc(5, 600, 60, 60), _lc(10, 5, 1, 1), _lc(15, 105, 11, 21)]
    w = window_counters(samples, 0.0, 15.0)
    assert w is not None and w.segments == 2 and w.generated_tokens == 200.0


def test_window_sglang_gauge_mal_uses_samples_while_running() -> None:
    idle_page = sglang_page(gen=100.0, accept_len=(9.0, 9.0)).replace("} 4.0", "} 0.0").replace("} 3.0", "} 0.0")
    idle = parse_exposition(idle_page)  # nothing running: its stale gauge (9.0) must not count
    busy = parse_exposition(sglang_page(gen=500.0, accept_len=(3.0, 2.0)))
    w = window_counters([sample(0, idle), sample(5, busy)], 0, 5)
    assert w is not None and w.mal == pytest.approx(2.5) and w.mal_source == "gauge"


def test_running_distribution_in_time_order_skipping_missing() -> None:
    samples = [_lc(10, 0, 0, 0, running=3), _lc(0, 0, 0, 0, running=1), _lc(5, 0, 0, 0, running=2),
               sample(7, parse_exposition(UNKNOWN_PAGE))]
    assert running_distribution(samples) == [1.0, 2.0, 3.0]
    assert running_distribution(samples, t0=4, t1=10) == [2.0, 3.0]


@st.composite
def sample_series(draw: st.DrawFn) -> list[ScrapeSample]:
    n = draw(st.integers(min_value=2, max_value=12))
    out: list[ScrapeSample] = []
    predicted = drafts = accepted = 0
    inst = 0
    for i in range(n):
        if i and draw(st.integers(0, 5)) == 0:  # a restart
            inst += 1
            predicted = drafts = accepted = 0
        step_drafts = draw(st.integers(0, 50))
        step_acc = draw(st.integers(0, 3 * step_drafts))
        drafts += step_drafts
        accepted += step_acc
        predicted += step_drafts + step_acc + draw(st.integers(0, 20))
        out.append(_lc(float(i * 5), predicted, drafts, accepted, inst=f"inst-{inst}"))
    return out


@settings(max_examples=60, deadline=None)
@given(series=sample_series(), data=st.data())
def test_windows_meeting_at_a_sample_add_up(series: list[ScrapeSample], data: st.DataObject) -> None:
    m = data.draw(st.integers(0, len(series) - 1))
    t0, tm, t1 = series[0].t_mono, series[m].t_mono, series[-1].t_mono
    whole = window_counters(series, t0, t1)
    left, right = window_counters(series, t0, tm), window_counters(series, tm, t1)

    def get(w: object, name: str) -> float:
        return 0.0 if w is None else float(getattr(w, name) or 0.0)

    for name in ("generated_tokens", "drafts", "accepted_tokens", "seconds"):
        assert get(whole, name) == get(left, name) + get(right, name), name
    if whole is not None:
        assert all(getattr(whole, n) >= 0 for n in ("generated_tokens", "drafts", "accepted_tokens"))
