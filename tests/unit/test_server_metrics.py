"""Reading a server's ``/metrics`` page (``specproxy.observe.server_metrics``): every server's shape, summed
over engines and ranks, missing families null, malformed text a ScrapeError. The pages are ``tests/pages.py``'s,
written out as each server prints them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.errors import UpstreamError
from pages import (LLAMACPP_FORK_PAGE, LLAMACPP_OLD_PAGE, UNKNOWN_PAGE,
                   VLLM_NO_SPEC_PAGE, VLLM_PAGE, llamacpp_page, sglang_page)
from specproxy.observe.server_metrics import ScrapeError, parse_exposition


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------


def test_vllm_page_sums_engines_and_ignores_created_and_histograms() -> None:
    snap = parse_exposition(VLLM_PAGE)
    assert snap.server_kind == "vllm"
    assert snap.requests_running == 5.0
    assert snap.requests_waiting == 1.0  # engine 0 is NaN: missing, not 0 and not NaN
    assert snap.generation_tokens_total == 2000.0  # `_created` (1.76e9) not added in
    assert snap.prompt_tokens_total == 80000.0
    assert (snap.spec_drafts_total, snap.spec_draft_tokens_total, snap.spec_accepted_tokens_total) == (
        200.0, 600.0, 360.0,
    )
    assert dict(snap.spec_accepted_per_pos or {}) == {0: 170.0, 1: 114.0, 2: 76.0}
    assert snap.spec_accept_length is None and snap.spec_accept_rate is None
    assert snap.process_start_time_seconds == 1.76e9
    assert snap.start_time == (1.76e9, "process_start_time_seconds")
    assert snap.created_min == pytest.approx(1.7600000123e9)
    assert snap.model_names == frozenset({"Qwen/Qwen3-32B"})
    assert snap.types["vllm:generation_tokens"] == "counter"  # parser strips `_total` from families
    assert snap.types["vllm:time_to_first_token_seconds"] == "histogram"


def test_raw_keeps_every_sample_including_nan_created_and_buckets() -> None:
    snap = parse_exposition(VLLM_PAGE)
    sample_lines = [ln for ln in VLLM_PAGE.splitlines() if ln and not ln.startswith("#")]
    assert len(snap.raw) == len(sample_lines)
    names = {s.name for s in snap.raw}
    assert "vllm:generation_tokens_created" in names
    assert "vllm:time_to_first_token_seconds_bucket" in names
    nan = [s for s in snap.raw if s.name == "vllm:kv_cache_usage_perc"]
    assert len(nan) == 2 and all(math.isnan(s.value) for s in nan)
    # labels are sorted pairs: hashable, one canonical form
    first = next(s for s in snap.raw if s.name == "vllm:num_requests_running")
    assert first.labels == (("engine", "0"), ("model_name", "Qwen/Qwen3-32B"))


def test_missing_families_are_none_not_zero() -> None:
    snap = parse_exposition(VLLM_NO_SPEC_PAGE.replace("{gen}", "10.0"))
    assert snap.server_kind == "vllm"
    assert snap.generation_tokens_total == 10.0
    for name in (
        "requests_waiting", "prompt_tokens_total", "spec_drafts_total", "spec_draft_tokens_total",
        "spec_accepted_tokens_total", "spec_accepted_per_pos", "process_start_time_seconds", "created_min",
    ):
        assert getattr(snap, name) is None, name
    assert snap.start_time == (None, None)


def test_all_nan_counter_is_missing() -> None:
    snap = parse_exposition(VLLM_NO_SPEC_PAGE.replace("{gen}", "NaN"))
    assert snap.generation_tokens_total is None


def test_llamacpp_page() -> None:
    snap = parse_exposition(llamacpp_page(per_pos=(400, 200)))
    assert snap.server_kind == "llamacpp"
    assert snap.requests_running == 1.0 and snap.requests_waiting == 0.0
    assert snap.generation_tokens_total == 1000.0
    assert snap.prompt_tokens_total == 4000.0  # not the cached counter next to it
    assert (snap.spec_drafts_total, snap.spec_draft_tokens_total, snap.spec_accepted_tokens_total) == (
        300.0, 900.0, 600.0,
    )
    assert dict(snap.spec_accepted_per_pos or {}) == {0: 400.0, 1: 200.0}
    assert snap.process_start_time_seconds is None and snap.model_names == frozenset()


def test_llamacpp_counters_as_gauges_without_total_and_with_model_label() -> None:
    snap = parse_exposition(LLAMACPP_FORK_PAGE)
    assert snap.server_kind == "llamacpp"
    assert snap.generation_tokens_total == 500.0  # TYPE gauge, name ends in _total
    assert snap.spec_drafts_total == 100.0  # TYPE counter without _total: parser renames the sample
    assert snap.spec_draft_tokens_total == 400.0  # TYPE gauge without _total
    assert snap.spec_accepted_tokens_total == 250.0  # untyped
    assert snap.requests_running == 2.0
    assert snap.model_names == frozenset({"qwen3-8b"})


def test_llamacpp_old_build_has_no_spec_counters() -> None:
    snap = parse_exposition(LLAMACPP_OLD_PAGE.format(predicted=3469))
    assert snap.server_kind == "llamacpp"
    assert snap.generation_tokens_total == 3469.0
    assert snap.spec_drafts_total is None and not snap.spec_exposed


def test_sglang_page_dedupes_tensor_parallel_ranks_and_sums_data_parallel() -> None:
    snap = parse_exposition(sglang_page())
    assert snap.server_kind == "sglang"
    assert snap.requests_running == 7.0  # 4 (dp0) + 3 (dp1); tp_rank 1 repeats tp_rank 0
    assert snap.requests_waiting == 1.0
    assert snap.generation_tokens_total == 147139.0
    assert snap.prompt_tokens_total == 4668037.0
    assert snap.spec_accept_length == pytest.approx(3.0)  # mean over dp ranks
    assert snap.spec_accept_rate == pytest.approx(0.6)
    assert snap.spec_drafts_total is None  # SGLang exposes gauges, not spec counters
    assert snap.process_start_time_seconds is None and snap.created_min is None
    assert snap.model_names == frozenset({"deepseek-ai/DeepSeek-V3"})


def test_unknown_server_keeps_raw_samples() -> None:
    snap = parse_exposition(UNKNOWN_PAGE)
    assert snap.server_kind == "unknown"
    assert snap.generation_tokens_total is None and snap.requests_running is None
    assert [(s.name, s.labels, s.value) for s in snap.raw] == [
        ("tgi_request_count_total", (("method", "POST"),), 17.0),
        ("tgi_batch_current_size", (), 3.0),
        ("tgi_request_duration_bucket", (("le", "1"),), 2.0),
        ("tgi_request_duration_bucket", (("le", "+Inf"),), 17.0),
        ("tgi_request_duration_sum", (), 20.5),
        ("tgi_request_duration_count", (), 17.0),
    ]


def test_empty_page_is_valid_and_unknown() -> None:
    snap = parse_exposition("")
    assert snap.server_kind == "unknown" and snap.raw == ()


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
        '{"error":{"code":501,"message":"This server does not support metrics endpoint.","type":"not_supported_error"}}',
        "llamacpp:tokens_predicted_total\n",  # truncated: no value
        'vllm:num_requests_running{engine="0" 3.0\n',  # unterminated labels
        "vllm:num_requests_running 3.0.1\n",
    ],
)
def test_malformed_text_raises_scrape_error(text: str) -> None:
    with pytest.raises(ScrapeError) as info:
        parse_exposition(text)
    assert "not a Prometheus text exposition" in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, UpstreamError)  # one exception tree


_SHAPES = {
    # How a counter can reach us: TYPE counter with/without `_total`, TYPE gauge with/without,
    # untyped. All must read the same.
    "counter_total": "# TYPE {n}_total counter\n{n}_total{{{l}}} {v}\n",
    "counter_bare": "# TYPE {n} counter\n{n}{{{l}}} {v}\n",
    "gauge_total": "# TYPE {n}_total gauge\n{n}_total{{{l}}} {v}\n",
    "gauge_bare": "# TYPE {n} gauge\n{n}{{{l}}} {v}\n",
    "untyped": "{n}{{{l}}} {v}\n",
}


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=6),
    shape=st.sampled_from(sorted(_SHAPES)),
)
def test_counter_sum_over_label_sets_in_any_shape(values: list[int], shape: str) -> None:
    text = ""
    for i, v in enumerate(values):
        # one family block per label set is legal text; emit a single TYPE line, then samples
        block = _SHAPES[shape].format(n="llamacpp:spec_decode_num_drafts", l=f'slot="{i}"', v=v)
        text += block if i == 0 else block.split("\n", 1)[1] if block.startswith("#") else block
    snap = parse_exposition(text)
    assert snap.spec_drafts_total == float(sum(values))


# ----------------------------------------------------------------------------------------------
# Prefix caching
# ----------------------------------------------------------------------------------------------


def test_vllm_prefix_cache_counters_summed_over_engines() -> None:
    from pages import VLLM_PREFIX_PAGE

    snap = parse_exposition(VLLM_PREFIX_PAGE.format(q0=1000.0, q1=500.0, h0=600.0, h1=100.0))
    assert snap.prefix_cache_queries_total == 1500.0 and snap.prefix_cache_hits_total == 700.0
    assert parse_exposition(VLLM_PAGE).prefix_cache_queries_total is None  # not exposed: None, not 0
    assert parse_exposition(VLLM_PAGE).prefix_cache_hits_total is None


def test_llamacpp_prefix_cache_lookups_are_its_computed_and_cached_prompt_tokens() -> None:
    """llama.cpp's prompt counter leaves the cached tokens out; its cached counter is the hits."""
    snap = parse_exposition(llamacpp_page(prompt=4000))
    assert snap.prefix_cache_hits_total == 12000.0 and snap.prefix_cache_queries_total == 16000.0
    old = parse_exposition(LLAMACPP_OLD_PAGE.format(predicted=3469))
    assert old.prefix_cache_hits_total is None and old.prefix_cache_queries_total is None


def test_the_prefix_cache_hit_rate_over_a_window() -> None:
    from pages import VLLM_PREFIX_PAGE
    from specproxy.observe.counters import delta

    a = parse_exposition(VLLM_PREFIX_PAGE.format(q0=1000.0, q1=500.0, h0=600.0, h1=100.0))
    b = parse_exposition(VLLM_PREFIX_PAGE.format(q0=3000.0, q1=1500.0, h0=2100.0, h1=500.0))
    d = delta(a, b, seconds=10.0)
    assert (d.prefix_cache_queries, d.prefix_cache_hits) == (3000.0, 1900.0)
    assert d.prefix_cache_hit_rate == pytest.approx(1900 / 3000) and d.to_dict()["prefix_cache_hit_rate"] == d.prefix_cache_hit_rate
    assert delta(a, a, seconds=10.0).prefix_cache_hit_rate is None  # nothing looked up: no rate
    # a counter that went down is a restart: nothing is known across it
    assert delta(b, a, seconds=10.0).restarted
