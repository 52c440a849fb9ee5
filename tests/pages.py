"""Servers' /metrics pages, written out literally: for the scrape, metrics, counters and retention tests."""

LLAMACPP_PAGE = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 12000
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 3.25
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {predicted}
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 41.5
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 900
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 8192
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {draft_tokens}
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {drafts}
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 812.3
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 40.7
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1
"""

# The other servers' pages, written out literally in the shape each prints (read in their sources: vLLM's
# prometheus_client registry, llama.cpp's ``to_metrics()``, SGLang's multiprocess collectors), so a change in
# the parsing shows up against what servers really send.
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

# vLLM V1 with prefix caching (on by default in V1): two counters in prompt tokens, looked up and found in
# the prefix cache, one series per engine (data parallel), typed counter and printed with `_total`.
VLLM_PREFIX_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 1.0
vllm:num_requests_running{{engine="1",model_name="m"}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {q0}
vllm:prompt_tokens_total{{engine="1",model_name="m"}} {q1}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} 100.0
vllm:generation_tokens_total{{engine="1",model_name="m"}} 50.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q0}
vllm:prefix_cache_queries_total{{engine="1",model_name="m"}} {q1}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h0}
vllm:prefix_cache_hits_total{{engine="1",model_name="m"}} {h1}
"""
