"""Tests for specproxy.observe.scrape / specproxy.observe.server_metrics: reading the server's own counters.

The exposition pages below are written out literally, in the shape each server prints (read in
their sources: vLLM's prometheus_client registry, llama.cpp's ``to_metrics()``, SGLang's
multiprocess collectors), so a change in our parsing shows up against what servers really send.
The scraper tests run a tiny aiohttp server on 127.0.0.1 and wait on events with deadlines.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.observe import scrape as scrape_mod
from specproxy.errors import UpstreamError
from pages import LLAMACPP_PAGE
from specproxy.observe.scrape import (
    PARSE_INLINE_MAX_BYTES,
    Instance,
    ScrapeError,
    ScrapeSample,
    Scraper,
    Snapshot,
    delta,
    identify_instance,
    parse_exposition,
    running_distribution,
    window_counters,
)

DEADLINE_S = 5.0

# ----------------------------------------------------------------------------------------------
# Literal pages
# ----------------------------------------------------------------------------------------------

# vLLM V1, data-parallel with two engines: prometheus_client prints counters with `_total`,
# a separate `_created` gauge family per counter, histograms, the process collector, and a NaN.
VLLM_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-32B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-32B"} NaN
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-32B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-32B"} NaN
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-32B"} NaN
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-32B"} 50000.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3-32B"} 30000.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-32B"} 1.7600000123e+09
vllm:prompt_tokens_created{engine="1",model_name="Qwen/Qwen3-32B"} 1.7600000125e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-32B"} 1200.0
vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-32B"} 800.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="Qwen/Qwen3-32B"} 1.7600000124e+09
vllm:generation_tokens_created{engine="1",model_name="Qwen/Qwen3-32B"} 1.7600000126e+09
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3-32B"} 120.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen/Qwen3-32B"} 80.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3-32B"} 360.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="Qwen/Qwen3-32B"} 240.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3-32B"} 216.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Qwen/Qwen3-32B"} 144.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-32B",position="0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-32B",position="1"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-32B",position="2"} 46.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3-32B",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3-32B",position="1"} 44.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3-32B",position="2"} 30.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-32B"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-32B"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-32B"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-32B"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-32B"} 4.2
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="Qwen/Qwen3-32B"} 1.7600000127e+09
"""

# vLLM without a speculative config: SpecDecodingProm registers no spec families at all.
VLLM_NO_SPEC_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} {gen}
"""

# llama.cpp upstream (server-task.cpp to_metrics): no labels, counters typed `counter` with
# `_total`, gauges, and the per-position family once a speculative request has finished.

LLAMACPP_PER_POS = """\
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {p0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {p1}
"""


def llamacpp_page(
    *, prompt: int = 4000, predicted: int = 1000, drafts: int = 300, draft_tokens: int = 900,
    accepted: int = 600, processing: int = 1, per_pos: tuple[int, int] | None = None,
) -> str:
    text = LLAMACPP_PAGE.format(
        prompt=prompt, predicted=predicted, drafts=drafts, draft_tokens=draft_tokens,
        accepted=accepted, processing=processing,
    )
    if per_pos is not None:
        text += LLAMACPP_PER_POS.format(p0=per_pos[0], p1=per_pos[1])
    return text


# A llama.cpp build before the spec-decode counters existed (it may still be drafting).
LLAMACPP_OLD_PAGE = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {predicted}
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

# A fork that types its counters as gauges, drops the `_total` suffix in places (llama.cpp's
# first spec-counter PR printed `llamacpp:spec_decode_num_drafts`) and labels by model.
LLAMACPP_FORK_PAGE = """\
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total gauge
llamacpp:tokens_predicted_total{model="qwen3-8b"} 500
# TYPE llamacpp:spec_decode_num_drafts counter
llamacpp:spec_decode_num_drafts{model="qwen3-8b"} 100
# TYPE llamacpp:spec_decode_num_draft_tokens gauge
llamacpp:spec_decode_num_draft_tokens{model="qwen3-8b"} 400
llamacpp:spec_decode_num_accepted_tokens{model="qwen3-8b"} 250
llamacpp:requests_processing{model="qwen3-8b"} 2
"""

# SGLang with tensor parallelism 2 and data parallelism 2: scheduler gauges carry the rank
# labels (each TP rank sees the same requests), tokenizer counters carry model_name only;
# multiprocess mode exposes no process_start_time_seconds and no `_created` samples.
SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 4.0
sglang:num_running_reqs{dp_rank="0",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="1"} 4.0
sglang:num_running_reqs{dp_rank="1",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="1"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="1",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} {accept_len_0}
sglang:spec_accept_length{dp_rank="1",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} {accept_len_1}
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{dp_rank="0",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 0.7
sglang:spec_accept_rate{dp_rank="1",model_name="deepseek-ai/DeepSeek-V3",pp_rank="0",tp_rank="0"} 0.5
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="deepseek-ai/DeepSeek-V3"} 4.668037e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="deepseek-ai/DeepSeek-V3"} {gen}
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="deepseek-ai/DeepSeek-V3"} 0.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="deepseek-ai/DeepSeek-V3"} 7.0
sglang:time_to_first_token_seconds_sum{model_name="deepseek-ai/DeepSeek-V3"} 3.5
sglang:time_to_first_token_seconds_count{model_name="deepseek-ai/DeepSeek-V3"} 7.0
"""


def sglang_page(gen: float = 147139.0, accept_len: tuple[float, float] = (3.2, 2.8)) -> str:
    return (
        SGLANG_PAGE.replace("{gen}", repr(gen))
        .replace("{accept_len_0}", repr(accept_len[0]))
        .replace("{accept_len_1}", repr(accept_len[1]))
    )


# Something specproxy has no table for (TGI-like names): every sample must survive in `raw`.
UNKNOWN_PAGE = """\
# HELP tgi_request_count Total number of requests
# TYPE tgi_request_count counter
tgi_request_count{method="POST"} 17
# HELP tgi_batch_current_size Current batch size
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 3
# HELP tgi_request_duration Request duration
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="1"} 2
tgi_request_duration_bucket{le="+Inf"} 17
tgi_request_duration_sum 20.5
tgi_request_duration_count 17
"""


def sample(t: float, snap: Snapshot, instance_id: str = "inst-a") -> ScrapeSample:
    return ScrapeSample(t_mono=t, t_wall=1_760_000_000.0 + t, snapshot=snap, instance_id=instance_id)


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


# ----------------------------------------------------------------------------------------------
# A tiny upstream on 127.0.0.1
# ----------------------------------------------------------------------------------------------


class FakeServer:
    """Serves whatever the test sets: a /metrics page (or a status), models, props, version."""

    def __init__(self) -> None:
        self.metrics_text = llamacpp_page()
        self.metrics_status: list[int] = []  # statuses to serve before the page, one per request
        self.metrics_headers: dict[str, str] = {}
        self.models: list[str] | None = ["qwen3-8b"]
        self.props: dict[str, object] | None = None
        self.version: dict[str, object] | None = None
        self.server_info: dict[str, object] | None = None
        self.metrics_requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/props", self._props)
        app.router.add_get("/version", self._version)
        app.router.add_get("/get_server_info", self._server_info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics_requests += 1
        if self.metrics_status:
            status = self.metrics_status.pop(0)
            return web.Response(status=status, text=f"status {status}\n")
        return web.Response(text=self.metrics_text, headers=self.metrics_headers, content_type="text/plain")

    async def _models(self, _request: web.Request) -> web.Response:
        if self.models is None:
            return web.Response(status=500, text="boom")
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _props(self, _request: web.Request) -> web.Response:
        return self._json(self.props)

    async def _version(self, _request: web.Request) -> web.Response:
        return self._json(self.version)

    async def _server_info(self, _request: web.Request) -> web.Response:
        return self._json(self.server_info)

    @staticmethod
    def _json(data: dict[str, object] | None) -> web.Response:
        return web.json_response(data) if data is not None else web.Response(status=404)


class Collector:
    """An ``on_sample`` that never blocks, and lets a test wait for a condition with a deadline."""

    def __init__(self) -> None:
        self.samples: list[ScrapeSample] = []
        self._waiters: list[tuple[Callable[[list[ScrapeSample]], bool], asyncio.Event]] = []

    def __call__(self, s: ScrapeSample) -> None:
        self.samples.append(s)
        for pred, event in self._waiters:
            if pred(self.samples):
                event.set()

    async def until(self, pred: Callable[[list[ScrapeSample]], bool]) -> None:
        if pred(self.samples):
            return
        event = asyncio.Event()
        self._waiters.append((pred, event))
        await asyncio.wait_for(event.wait(), DEADLINE_S)


def run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 4 * DEADLINE_S))  # type: ignore[arg-type]


def test_scraper_counts_samples_and_changing_counters() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 3)
            srv.metrics_text = llamacpp_page(predicted=1200, drafts=350, draft_tokens=1050, accepted=700)
            await got.until(lambda s: s[-1].snapshot.generation_tokens_total == 1200.0)
            await scraper.stop()
            assert not scraper.running
            assert scraper.samples == len(got.samples) >= 4
            assert scraper.failures == 0 and scraper.last_error is None
            ids = {s.instance_id for s in got.samples}
            assert scraper.instance_id is not None and scraper.instance_id.startswith("inst-")
            assert ids == {scraper.instance_id}
            assert [s.t_mono for s in got.samples] == sorted(s.t_mono for s in got.samples)
            assert all(s.latency_s is not None and s.latency_s >= 0 for s in got.samples)
            w = window_counters(got.samples, got.samples[0].t_mono, got.samples[-1].t_mono)
            assert w is not None and w.generated_tokens == 200.0 and w.mal == pytest.approx(1 + 100 / 50)

    run(main)


def test_scraper_counts_500_as_failure_without_raising() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [500, 500]
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 1)
            await scraper.stop()
            assert scraper.failures == 2
            assert scraper.last_error == "ScrapeError: HTTP 500"
            assert scraper.disabled_reason is None

    run(main)


def test_scrape_once_survives_malformed_page_and_refused_connection() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = "<html>oops</html>\n"
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and "not a Prometheus text exposition" in (scraper.last_error or "")
            closed_url = srv.url
        async with aiohttp.ClientSession() as session:  # server gone: connection refused
            scraper = Scraper(session, closed_url, interval_s=1.0, timeout_s=1.0)
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and scraper.last_error

    run(main)


@pytest.mark.parametrize("status", [404, 501])
def test_scraper_turns_itself_off_when_there_is_no_metrics_endpoint(status: int) -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [status] * 100
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=Collector())
            scraper.start()
            await asyncio.wait_for(scraper.wait(), DEADLINE_S)
            assert not scraper.running
            assert scraper.disabled_reason and str(status) in scraper.disabled_reason
            assert srv.metrics_requests == 1 and scraper.samples == 0
            scraper.start()  # stays off
            assert not scraper.running

    run(main)


def test_404_after_a_success_is_a_failure_not_a_shutdown() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is not None
            srv.metrics_status = [404]
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and scraper.disabled_reason is None

    run(main)


def test_scraper_reidentifies_on_restart_with_new_start_time() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            srv.version = {"version": "0.11.0"}
            srv.models = ["Qwen/Qwen3-32B"]
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            first = scraper.instance
            assert first is not None and first.build == "0.11.0" and first.start_time == 1.76e9
            srv.metrics_text = VLLM_PAGE.replace("seconds 1.76e+09", "seconds 1.77e+09")  # process start
            await got.until(lambda s: any(x.restart for x in s))
            await scraper.stop()
            restart_at = next(i for i, s in enumerate(got.samples) if s.restart)
            assert got.samples[restart_at].instance_id != first.instance_id
            assert {s.instance_id for s in got.samples[restart_at:]} == {scraper.instance_id}
            assert scraper.restarts == 1 and scraper.instance is not None
            assert scraper.instance.start_time == 1.77e9 and scraper.instance.restart_epoch is None

    run(main)


def test_restart_without_start_time_gets_a_new_id_each_time() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            ids = [scraper.instance_id]
            for n in (1, 2):
                srv.metrics_text = llamacpp_page(predicted=1, drafts=0, draft_tokens=0, accepted=0)

                def restarted_n(s: list[ScrapeSample], n: int = n) -> bool:
                    return sum(x.restart for x in s) >= n

                await got.until(restarted_n)
                ids.append(scraper.instance_id)
                srv.metrics_text = llamacpp_page(predicted=5000, drafts=0, draft_tokens=0, accepted=0)
                await got.until(lambda s: s[-1].snapshot.generation_tokens_total == 5000.0)
            await scraper.stop()
            assert len(set(ids)) == 3, ids
            assert scraper.instance is not None and scraper.instance.restart_epoch is not None

    run(main)


def test_model_change_found_by_periodic_identity_check() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got, identify_every_s=0.0)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            first = scraper.instance_id
            srv.models = ["qwen3-32b"]
            await got.until(lambda s: any(x.restart for x in s))
            await scraper.stop()
            assert scraper.instance_id != first
            assert scraper.instance is not None and scraper.instance.models == ("qwen3-32b",)

    run(main)


def test_failed_identity_lookup_does_not_fake_a_restart() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got, identify_every_s=0.0)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            srv.models = None  # /v1/models now answers 500
            n = len(got.samples)
            await got.until(lambda s: len(s) >= n + 3)
            await scraper.stop()
            assert not any(s.restart for s in got.samples) and scraper.restarts == 0

    run(main)


def test_callback_exception_does_not_stop_the_poller() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()

            def flaky(s: ScrapeSample) -> None:
                got(s)
                if len(got.samples) == 1:
                    raise RuntimeError("consumer bug")

            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=flaky)
            scraper.start()
            await got.until(lambda s: len(s) >= 3)
            await scraper.stop()
            assert scraper.callback_failures == 1 and scraper.failures == 0

    run(main)


def test_stop_is_prompt_even_with_a_long_interval() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=3600.0, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 1)
            await asyncio.wait_for(scraper.stop(), 2.0)
            assert not scraper.running and srv.metrics_requests == 1

    run(main)


def test_large_pages_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = asyncio.to_thread

    async def spy(fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)  # the module object scrape.py calls through

    # A page above the inline limit (llama.cpp's own is ~2.5 KB, a vLLM page ~40 KB).
    big = llamacpp_page() + "".join(
        f'tgi_padding{{i="{i}"}} {i}\n' for i in range(PARSE_INLINE_MAX_BYTES // 20)
    )

    async def main_big() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = big
            scraper = Scraper(session, srv.url, interval_s=1.0)
            s = await scraper.scrape_once()
            assert s is not None and s.snapshot.generation_tokens_total == 1000.0

    async def main_small() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = LLAMACPP_OLD_PAGE.format(predicted=1)
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is not None

    run(main_small)
    assert scrape_mod.parse_exposition not in calls
    run(main_big)
    assert scrape_mod.parse_exposition in calls


def test_scraper_makes_no_blocking_call_on_the_event_loop() -> None:
    from blockbuster import blockbuster_ctx

    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            with blockbuster_ctx():
                scraper.start()
                await got.until(lambda s: len(s) >= 3)
                await scraper.stop()
            # blockbuster raises inside the loop; the scraper would count it, so both must be 0
            assert scraper.failures == 0 and scraper.callback_failures == 0
            assert len(srv.metrics_text) > PARSE_INLINE_MAX_BYTES  # the threaded parse ran too

    run(main)


# ----------------------------------------------------------------------------------------------
# Instance identity
# ----------------------------------------------------------------------------------------------


def test_identify_llamacpp_from_props_models_and_start_header() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_headers = {"Process-Start-Time-Unix": "1760000000"}
            srv.props = {"build_info": "b6100-deadbee", "model_path": "/models/qwen3-8b-q4_k_m.gguf", "total_slots": 4}
            inst = await identify_instance(session, srv.url)
            assert inst.server_kind == "llamacpp"
            assert inst.start_time == 1.76e9 and inst.start_time_source == "Process-Start-Time-Unix"
            assert inst.models == ("qwen3-8b",) and inst.build == "b6100-deadbee"
            assert inst.model_path == "/models/qwen3-8b-q4_k_m.gguf" and inst.total_slots == 4
            assert inst.errors == ()
            again = await identify_instance(session, srv.url + "/")
            assert again.instance_id == inst.instance_id  # stable, URL normalized
            srv.props = {**srv.props, "build_info": "b6200-cafe"}
            assert (await identify_instance(session, srv.url)).instance_id != inst.instance_id

    run(main)


def test_identify_vllm_and_sglang_builds() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            srv.models = ["Qwen/Qwen3-32B"]
            srv.version = {"version": "0.11.0"}
            inst = await identify_instance(session, srv.url)
            assert (inst.server_kind, inst.build) == ("vllm", "0.11.0")
            assert inst.start_time_source == "process_start_time_seconds"
            srv.metrics_text = sglang_page()
            srv.server_info = {"version": "0.5.3", "model_path": "deepseek-ai/DeepSeek-V3"}
            inst = await identify_instance(session, srv.url)
            assert (inst.server_kind, inst.build, inst.model_path) == ("sglang", "0.5.3", "deepseek-ai/DeepSeek-V3")
            assert inst.start_time is None

    run(main)


def test_identify_tolerates_every_failure() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [500]
            srv.models = None
            inst = await identify_instance(session, srv.url)
            assert isinstance(inst, Instance) and inst.server_kind == "unknown"
            assert inst.models is None and inst.build is None
            assert any(e.startswith("/metrics") for e in inst.errors)
            assert any(e.startswith("/v1/models") for e in inst.errors)
            url = srv.url
        async with aiohttp.ClientSession() as session:
            inst = await identify_instance(session, url, timeout_s=1.0)  # nobody listening
            assert inst.instance_id.startswith("inst-") and len(inst.errors) >= 2

    run(main)
