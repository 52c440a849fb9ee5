"""A finished turn's Record: what the forwarding path recorded of it (``TurnRecorder``), read and derived.

Why apart from the recorder: the recorder is what the wire drives, on the event loop and (its kept reads)
the relay thread, and may only append; this is the CPU work (SSE decoding, JSON parsing, decompression,
tokenizing, the prompt compared with the session's last), run once per turn in the measuring thread after
the last byte was forwarded. Events are timed by the read that completed them, so deferring the parse
loses no precision.

What a response delivered (text per choice and kind, and when) is read by one function per API:
``Api.read_stream`` for a stream (``apis.py``: the chat stream's native reader, else the reference of
``texts.py``), ``texts.body_texts`` with the API's body reader for a whole body. When the proxy relayed
HTTP/1.1 chunked framing verbatim, ``response_body.read_response`` removes the framing, undoes a
Content-Encoding and reads, consuming the reads as it joins them.

``build_record`` is where a measured turn's Record is made, ``unmeasured_record`` the row of a turn whose
measuring failed; both construct it in ``_record_of``, the one place a Record is constructed from a turn.
"""

from __future__ import annotations

from operator import sub

import orjson

from specproxy.measure.apis import CHAT, Api, api_for
from specproxy.measure.chunk_gaps import StreamTiming, gap_buckets
from specproxy.measure.completion import cache_write_tokens, cached_tokens, content_class_of, count_completion, int_or_none
from specproxy.measure.failures import FAILURES
from specproxy.measure.prefix import PrefixTracker, TurnPrefix, tool_names
from specproxy.measure.request_body import RequestRead, inflate, model_only, read_request
from specproxy.measure.response_body import read_response
from specproxy.measure.session import client_of, session_of
from specproxy.measure.texts import Texts
from specproxy.measure.tokens import Tokenizer, over_max_counted_items
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.record import Record

__all__ = ["build_record", "unmeasured_record"]


def build_record(turn: TurnRecorder, tokenizer: Tokenizer | None, prefixes: PrefixTracker | None = None, *,
                 fast: bool = True) -> Record:
    """The Record of a finished turn. CPU work: call from a worker thread, once, after ``finish``/``fail``
    (it consumes the turn's reads). ``prefixes``: the sessions' previous turns, to compare this one with
    (``prefix_reused_tokens``, ``turn_diff``). ``fast=False`` reads a stream with the reference alone (for
    differential tests)."""
    assert turn.ended, "build before finish/fail"
    turn.take_relayed()
    if not turn.measured:
        outcome = turn.outcome or "ok"
        if outcome == "ok" and turn.status is not None and turn.status >= 400:
            outcome = "upstream_error"
        return _record_of(turn, measured=False, outcome=outcome, error=turn.error)
    api = api_for(turn.path) or CHAT
    if not turn.body and turn.shed:  # let go of before measuring: the prompt is unknown, not unreadable
        request = RequestRead(parsed=False)
    elif turn.request_bytes > turn.max_counted:
        # not parsed (orjson takes twice the body's size to parse it), counted or compared: its model
        # is read by a byte search for its one "model" key
        request = RequestRead(parsed=False, model=model_only(inflate(turn.body, turn.request_encoding)))
        turn.shed.append("prompt_over_max_counted_bytes")
    else:
        request = read_request(inflate(turn.body, turn.request_encoding), api)
    streamed = turn.content_type.startswith("text/event-stream")
    reads, turn.reads = (turn.reads, []) if fast else (list(turn.reads), turn.reads)  # consumed below
    texts, response_bytes, framing_error = read_response(
        reads, turn.read_times, api, streamed=streamed, chunked=turn.chunked,
        content_encoding=turn.content_encoding, fast=fast, let_go=turn.trim_heap, max_parsed=turn.max_counted)
    if texts.unparsed and "response_over_max_counted_bytes" not in turn.shed:
        turn.shed.append("response_over_max_counted_bytes")
    outcome = turn.outcome or "ok"
    if outcome == "client_abort" and texts.saw_done:
        outcome = "ok"  # the client (e.g. the openai SDK) hung up after reading [DONE]: all delivered
    if outcome == "ok" and ((turn.status is not None and turn.status >= 400) or texts.error is not None):
        outcome = "upstream_error"  # an error status, or an error event in a 200 stream
    return _derive(turn, request, texts, streamed, outcome, tokenizer, response_bytes, framing_error, api, prefixes)


def _derive(
    turn: TurnRecorder,
    request: RequestRead,
    texts: Texts,
    streamed: bool,
    outcome: str,
    tok: Tokenizer | None,
    response_bytes: int,
    framing_error: str | None,
    api: Api = CHAT,
    prefixes: PrefixTracker | None = None,
) -> Record:
    """A measured turn's figures, from its request and response as read (``texts``), made its Record."""
    t_req = turn.t_request
    # several completions prompts: the turn is the first and its answer, as the server's usage is
    first_only = request.parts is not None and request.parts.prompts > 1
    if tok is not None and sum(map(len, texts.texts.values())) > turn.max_counted:
        turn.shed.append("completion_over_max_counted_bytes")  # about 1 s of tokenizer per 4 MiB
        counts = None
    else:
        counts = count_completion(texts, tok, first_only) if tok is not None else None
    prompt = None
    if tok is not None and request.parts is not None and over_max_counted_items(request.parts):
        turn.shed.append("prompt_over_max_counted_items")  # work per message, as max_counted is per byte
    elif tok is not None and request.parts is not None:
        try:
            prompt = tok.count_prompt(request.parts)
        except Exception as exc:  # the prompt's figures are null; the turn keeps the rest
            FAILURES.note("counting the prompt failed, its figures null", exc)
    usage = texts.usage or {}
    ttft = texts.t_first - t_req if texts.t_first is not None else None
    decode = texts.t_last - texts.t_first if texts.t_first is not None and texts.t_last is not None else None
    completion = counts["completion"] if counts else None
    if (counts is None and tok is not None and not texts.texts and texts.unreadable is None
            and not texts.unparsed and turn.status is not None and turn.status < 400 and not turn.capped):
        completion = 0  # a tokenizer and a successful answer read with no text: truly zero tokens
    decode_tps = None
    if counts and decode and decode > 0:
        decode_tps = (counts["completion"] - counts["first"]) / decode
    if streamed:  # what the per-chunk metrics need, handed beside the record (chunk_gaps.py)
        # bucketed by the C scans already, else (every other path) from when the chunks arrived
        gaps = texts.gaps if texts.gaps is not None else gap_buckets(texts.chunk_times, texts.chunk_counts)
        turn.timing = StreamTiming(texts.t_first_event - t_req if texts.t_first_event is not None else None,
                                   gaps[0] if gaps else None, gaps[1] if gaps else 0.0)
    delays = sorted(map(sub, turn.write_times, turn.read_times))  # per read: write done - read
    client = client_of(turn.headers, turn.client_header)
    session = session_of(client, request.model, request.parts)
    prefix = TurnPrefix()
    if prefixes is not None:
        try:
            prefix = prefixes.observe(session, tok if prompt is not None else None, request.parts)
        except Exception as exc:  # the comparison's figures are null; the turn keeps the rest
            FAILURES.note("comparing the prompt with the previous turn failed, its figures null", exc)
    # the tools this turn's answer called: unknown when no response came or its body could not be read
    read = turn.t_upstream_headers is not None and texts.unreadable is None
    tools_defined, tools_called, names = tool_names(request.parts, texts.calls if read else None, turn.store_text)
    response_text = None
    if turn.store_text and texts.texts:
        response_text = "".join(texts.texts[k] for k in sorted(texts.texts))
    return _record_of(
        turn,
        api=api.name,
        client=client,
        session=session,
        prefix_reused_tokens=prefix.reused,
        prefix_break_part=prefix.part,
        prompt_block_digests=prefix.blocks,
        turn_diff=orjson.dumps(prefix.diff).decode() if prefix.diff is not None else None,
        tools_defined=tools_defined,
        tools_called=tools_called,
        tool_names=names,
        outcome=outcome,
        error=turn.error
        or framing_error
        or texts.error
        or (f"{texts.bad_events} stream events were not JSON" if texts.bad_events else None)
        or (texts.unreadable if turn.status is not None and turn.status < 400 else None),
        streamed=streamed,
        model=request.model,
        request_parsed=request.parsed,
        t_first_token=texts.t_first,
        t_last_token=texts.t_last,
        ttft_s=ttft,
        decode_s=decode,
        completion_tokens=completion,
        content_tokens=counts["content"] if counts else None,
        reasoning_tokens=counts["reasoning"] if counts else None,
        tool_args_tokens=counts["tool_args"] if counts else None,
        content_class=content_class_of(texts),
        first_chunk_tokens=counts["first"] if counts else None,
        usage_completion_tokens=int_or_none(usage.get("completion_tokens")),
        usage_prompt_tokens=int_or_none(usage.get("prompt_tokens")),
        usage_cached_tokens=cached_tokens(usage, texts.timings),
        usage_cache_write_tokens=cache_write_tokens(usage),
        chunks=texts.chunks if (texts.chunks or turn.status is not None) else None,
        tokens_per_chunk=counts["completion"] / texts.chunks if counts and texts.chunks else None,
        decode_tps=decode_tps,
        prompt_tokens=prompt.total if prompt else None,
        prompt_system_tokens=prompt.system if prompt else None,
        prompt_tools_tokens=prompt.tools if prompt else None,
        prompt_history_tokens=prompt.history if prompt else None,
        prompt_new_tokens=prompt.new if prompt else None,
        proxy_delay_s=_median_sorted(delays) if delays else None,
        response_bytes=response_bytes,
        saw_done=texts.saw_done,
        finish_reason=texts.finish_reason,
        server_timings=orjson.dumps(texts.timings).decode() if texts.timings else None,
        tokenizer=tok.name if tok is not None else None,
        prompt_text=turn.body.decode("utf-8", "replace") if turn.store_text else None,
        response_text=response_text,
    )


def unmeasured_record(turn: TurnRecorder, error: str) -> Record:
    """The row of a turn whose measuring failed (``build_record`` raised): what the forwarding path knew,
    nothing derived, so the turn is still counted. ``error`` says where it failed, never what was sent."""
    return _record_of(
        turn,
        outcome="proxy_error",
        error=f"{error}; forwarding outcome {turn.outcome}"[:300],
        response_bytes=turn.response_kept,
    )


def _capped_reason(turn: TurnRecorder) -> str | None:
    why = []
    if turn.capped:
        why.append("response_memory_budget" if turn.budget_capped else "response_over_max_measured_bytes")
    why.extend(turn.shed)
    return ",".join(why) if why else None


def _record_of(turn: TurnRecorder, **derived) -> Record:
    """The one place a turn's Record is constructed: what the forwarding path stamped, plus
    ``derived`` (what ``_derive`` read from the bytes, or what ``unmeasured_record`` could say)."""
    return Record(
        id=turn.id,
        t_wall=turn.t_wall,
        method=turn.method,
        path=turn.path,
        status=turn.status,
        label=turn.label,
        proxy_name=turn.proxy_name,
        tenant=turn.tenant_rule.of(turn.headers) if turn.tenant_rule is not None else None,
        instance_id=turn.instance_id,
        concurrency=turn.concurrency,
        conn_id=turn.conn_id,
        t_request=turn.t_request,
        t_upstream_headers=turn.t_upstream_headers,
        t_done=turn.t_done,
        total_s=turn.t_done - turn.t_request if turn.t_done is not None else None,
        request_bytes=turn.request_bytes,
        measure_capped=turn.measured and (turn.capped or bool(turn.shed)),
        measure_capped_reason=_capped_reason(turn) if turn.measured else None,
        **derived,
    )


def _median_sorted(values: list[float]) -> float:
    """``statistics.median`` of an already sorted, non-empty list, without its per-call overhead."""
    mid = len(values) // 2
    return values[mid] if len(values) & 1 else (values[mid - 1] + values[mid]) / 2
