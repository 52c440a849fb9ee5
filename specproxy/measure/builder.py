"""``RecordBuilder``: turns the bytes of one turn, stamped as they crossed the sockets, into a Record.

Why it is shaped this way: the forwarding path may only append (``on_bytes`` is three list appends);
everything that costs CPU (SSE decoding, JSON parsing, decompression, tokenizing) happens in ``build``,
which runs once per turn in a worker thread after the last byte was forwarded. Events are timed by the
read that completed them, so deferring the parse loses no precision.

What a response delivered (text per choice and kind, and when) is read by one function per API:
``Api.read_stream`` for a stream (``apis.py``: the chat stream's native reader, else the reference of
``texts.py``), ``texts.body_texts`` with the API's body reader for a whole body.

When the proxy relays HTTP/1.1 chunked framing verbatim (``on_headers(..., chunked=True)``), the reads
hold framed bytes; ``build`` hands them to ``response_body.read_response``, which removes the framing,
undoes a Content-Encoding and reads, consuming the reads as it joins them.

Lifecycle (an invariant, asserted): ``RecordBuilder(...)`` -> ``on_headers`` (at most once) ->
``on_bytes`` (any number) -> exactly one of ``finish`` or ``fail`` -> ``build`` (once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import sub

import orjson

from specproxy.measure.apis import CHAT, Api, api_for, is_measured
from specproxy.measure.chunk_gaps import StreamTiming, gap_buckets
from specproxy.measure.completion import cache_write_tokens, cached_tokens, content_class_of, count_completion, int_or_none
from specproxy.measure.failures import FAILURES
from specproxy.measure.prefix import PrefixTracker, TurnPrefix, tool_names
from specproxy.measure.request_body import RequestRead, inflate, model_only, read_request
from specproxy.measure.session import client_of, session_of
from specproxy.record import Record, new_turn_id
from specproxy.measure.response_body import read_response
from specproxy.measure.tenant import TenantRule
from specproxy.measure.texts import Texts
from specproxy.measure.tokens import Tokenizer, over_max_counted_items

__all__ = ["RecordBuilder", "is_measured"]


class RecordBuilder:
    """Collects one turn on the forwarding path; ``build`` makes the Record off it."""

    __slots__ = (
        "_ended",
        "_let_go",
        "_small_after",
        "_take",
        "backlog_charge",
        "body",
        "body_charge",
        "budget_capped",
        "max_counted",
        "chunked",
        "concurrency",
        "conn_id",
        "content_encoding",
        "content_type",
        "error",
        "client_header",
        "headers",
        "id",
        "kept_bytes",
        "instance_id",
        "capped",
        "label",
        "measured",
        "method",
        "outcome",
        "path",
        "proxy_name",
        "relayed",
        "read_times",
        "request_bytes",
        "request_encoding",
        "reads",
        "shed",
        "room",
        "status",
        "store_text",
        "t_done",
        "t_request",
        "t_upstream_headers",
        "t_wall",
        "tenant_rule",
        "timing",
        "write_times",
    )

    def __init__(
        self,
        *,
        method: str,
        path: str,
        body: bytes,
        t_wall: float,
        t_request: float,
        concurrency: int = 1,
        label: str | None = None,
        instance_id: str | None = None,
        conn_id: int | None = None,
        store_text: bool = False,
        request_encoding: str = "",
        headers: Sequence[tuple[bytes, bytes]] = (),
        max_bytes: int | None = None,
        measured: bool = True,
        client_header: bytes = b"user-agent",
        take: Callable[[int, bool], bool] | None = None,
        body_charge: int = 0,
        max_counted: int | None = None,
        proxy_name: str | None = None,
        let_go: Callable[[], None] | None = None,
        tenant_rule: TenantRule | None = None,
    ) -> None:
        """``headers``: the request's raw headers (kept as a reference; the client, ``client_header``'s
        value, is read off the loop).
        ``measured=False``: a path specproxy does not measure; its row says what the forwarding path
        saw (method, path, status, timings, outcome), and none of its body is kept.
        ``take``: charges a kept response read to the process's memory budget (``wire.memory.take``; the
        first ``SMALL_KEEP`` bytes as a small turn's), False when it has no room: that read and every
        later one is relayed, not kept. ``body_charge``: what the
        request body was charged to it (``let_go`` gives both back). ``max_counted``: Config
        ``max_counted_bytes``, the most prompt and completion bytes the tokenizer counts. ``let_go``:
        gives freed heap pages back to the system (``wire.memory.trim``), called while a large response
        is joined, so that the reads already copied do not stay in RSS beside their copy. ``tenant_rule``:
        how the turn's ``tenant`` is named (from the headers, in the measuring thread)."""
        self.id = new_turn_id()  # known before the record is built, so counter deltas can join it
        self.method = method
        self.path = path
        self.body = body
        self.request_bytes = len(body)
        self.body_charge = body_charge
        self._take = take if take is not None else _no_budget
        self._let_go = let_go
        self.max_counted = max_counted if max_counted is not None else 1 << 62
        self.shed: list[str] = []  # what was let go of before measuring, to stay within the memory budget
        self.backlog_charge = 0  # the proxy's: what this turn held against the budget when it queued
        self.t_wall = t_wall
        self.t_request = t_request
        self.concurrency = concurrency
        self.label = label
        self.proxy_name = proxy_name
        self.tenant_rule = tenant_rule
        self.instance_id = instance_id
        self.conn_id = conn_id
        self.store_text = store_text
        self.request_encoding = request_encoding
        self.headers = headers
        self.client_header = client_header
        self.measured = measured
        if not measured:
            max_bytes = 0
        self.status: int | None = None
        self.content_type = ""
        self.content_encoding = ""
        self.chunked = False
        self.t_upstream_headers: float | None = None
        self.reads: list[bytes] = []
        self.kept_bytes = 0  # of the reads kept (build consumes the list; the budget's charge stays known)
        self.read_times: list[float] = []
        self.write_times: list[float] = []
        self.relayed = None  # reads the relay thread kept (a _relayc.Turn), taken off the loop: take_relayed()
        # bytes of the response still to keep (``max_bytes``); past it reads are relayed, not kept
        self.room = max_bytes if max_bytes is not None else 1 << 62
        self._small_after = self.room - SMALL_KEEP  # the first SMALL_KEEP bytes kept are a small turn's
        self.capped = False
        self.budget_capped = False  # ``capped`` because the memory budget had no room (not ``max_bytes``)
        self.t_done: float | None = None
        self.outcome: str | None = None
        self.error: str | None = None
        self.timing: StreamTiming | None = None  # set by build for a stream: the metrics', not stored
        self._ended = False

    # --- the forwarding path (specproxy.recorder.Recorder): cheap, no parsing ------------------------

    @property
    def ended(self) -> bool:
        """``finish`` or ``fail`` was called: the turn's outcome is decided."""
        return self._ended

    def on_headers(
        self, t: float, status: int, content_type: str, content_encoding: str = "", *, chunked: bool = False
    ) -> None:
        """``chunked``: the reads will hold the response's HTTP/1.1 chunked framing as relayed verbatim."""
        assert self.t_upstream_headers is None, "on_headers called twice"
        self.t_upstream_headers = t
        self.status = status
        self.content_type = content_type
        self.content_encoding = content_encoding
        self.chunked = chunked

    def on_bytes(self, data: bytes, t_read: float, t_written: float) -> None:
        """One read relayed. Kept while the kept bytes fit in ``max_bytes``; from the first read that does
        not, none is (the reads kept are the body's first ones, in order) and ``capped`` says so."""
        self.room -= len(data)
        if self.room >= 0 and self._take(len(data), self._small_after <= self.room):
            self.reads.append(data)
            self.kept_bytes += len(data)
            self.read_times.append(t_read)
            self.write_times.append(t_written)
        else:
            if self.room >= 0:  # the process's memory budget is spent: keep nothing more of this body
                self.room = -1
                self.budget_capped = True
            self.capped = True

    def relayed_by_thread(self, turn) -> None:
        """The relay thread relayed the rest of the body: its reads (after those already appended) are in
        ``turn``, and become Python objects in ``take_relayed``, in the measuring thread, not on the loop."""
        self.relayed = turn

    def take_relayed(self) -> None:
        """Append the reads the relay thread kept (once; nothing when it relayed none). Off the loop."""
        turn, self.relayed = self.relayed, None
        if turn is not None:
            before = len(self.reads)
            turn.take(self.reads, self.read_times, self.write_times)
            self.kept_bytes += sum(map(len, self.reads[before:]))
            self.capped = self.capped or turn.capped
            self.budget_capped = self.budget_capped or getattr(turn, "capped_budget", False)

    # --- the memory budget: what this turn holds, and letting go of it -----------------------------

    def charged(self) -> int:
        """Bytes this turn holds against the memory budget: its request body's charge and every response
        read kept (the relay thread's too, taken or not)."""
        kept = self.kept_bytes if self._take is not _no_budget else 0
        if self.relayed is not None:
            kept += self.relayed.kept
        return self.body_charge + kept

    def shed_prompt(self) -> int:
        """Let go of the request body before measuring (the prompt will not be counted; the record keeps
        its size and says why). Returns the bytes given back to the budget."""
        freed, self.body_charge = self.body_charge, 0
        if self.body:
            self.body = b""
            self.shed.append("prompt_memory_budget")
        return freed

    def shed_response(self) -> int:
        """Let go of the response reads before measuring (the record says why: none of its body is read).
        Returns the bytes given back to the budget."""
        freed = self.let_go(body=False)
        self.capped = self.budget_capped = True
        return freed

    def let_go(self, body: bool = True) -> int:
        """After ``build`` (or instead of it): drop the response reads, and the body with ``body``, so
        that their memory returns at once. Returns the bytes to give back to the budget."""
        freed = self.kept_bytes if self._take is not _no_budget else 0  # (charged by take alone)
        turn, self.relayed = self.relayed, None
        if turn is not None:
            freed += turn.kept
        self.reads = []
        self.kept_bytes = 0
        if body:
            freed += self.body_charge
            self.body_charge = 0
            self.body = b""
        return freed

    def finish(self, t_done: float, outcome: str = "ok", error: str | None = None) -> None:
        """The response ended (normally, or with an outcome the proxy observed)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.error = error

    def fail(self, t_done: float, outcome: str, status: int | None, error: str) -> None:
        """No response came from the upstream (the client got an error from specproxy itself)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.status = status
        self.error = error

    # --- off the forwarding path: parse, count, derive ------------------------------------------

    def build(self, tokenizer: Tokenizer | None, prefixes: PrefixTracker | None = None) -> Record:
        """Make the Record. CPU work: call from a worker thread, once, after finish/fail. ``prefixes``:
        the sessions' previous turns, to compare this one with (``prefix_reused_tokens``, ``turn_diff``)."""
        return self._build(tokenizer, fast=True, prefixes=prefixes)

    def _build(self, tokenizer: Tokenizer | None, *, fast: bool, prefixes: PrefixTracker | None = None) -> Record:
        """``fast=False`` reads a stream with the reference alone (for differential tests)."""
        assert self._ended, "build before finish/fail"
        self.take_relayed()
        if not self.measured:
            outcome = self.outcome or "ok"
            if outcome == "ok" and self.status is not None and self.status >= 400:
                outcome = "upstream_error"
            return self._make(measured=False, outcome=outcome, error=self.error)
        api = api_for(self.path) or CHAT
        if not self.body and self.shed:  # let go of before measuring: the prompt is unknown, not unreadable
            request = RequestRead(parsed=False)
        elif self.request_bytes > self.max_counted:
            # not parsed (orjson takes twice the body's size to parse it), counted or compared: its model
            # is read by a byte search for its one "model" key
            request = RequestRead(parsed=False, model=model_only(inflate(self.body, self.request_encoding)))
            self.shed.append("prompt_over_max_counted_bytes")
        else:
            request = read_request(inflate(self.body, self.request_encoding), api)
        streamed = self.content_type.startswith("text/event-stream")
        reads, self.reads = (self.reads, []) if fast else (list(self.reads), self.reads)  # consumed below
        texts, response_bytes, framing_error = read_response(
            reads, self.read_times, api, streamed=streamed, chunked=self.chunked,
            content_encoding=self.content_encoding, fast=fast, let_go=self._let_go, max_parsed=self.max_counted)
        if texts.unparsed and "response_over_max_counted_bytes" not in self.shed:
            self.shed.append("response_over_max_counted_bytes")
        outcome = self.outcome or "ok"
        if outcome == "client_abort" and texts.saw_done:
            outcome = "ok"  # the client (e.g. the openai SDK) hung up after reading [DONE]: all delivered
        if outcome == "ok" and ((self.status is not None and self.status >= 400) or texts.error is not None):
            outcome = "upstream_error"  # an error status, or an error event in a 200 stream
        return self._record(request, texts, streamed, outcome, tokenizer, response_bytes, framing_error, api,
                            prefixes)

    def _record(
        self,
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
        t_req = self.t_request
        # several completions prompts: the turn is the first and its answer, as the server's usage is
        first_only = request.parts is not None and request.parts.prompts > 1
        if tok is not None and sum(map(len, texts.texts.values())) > self.max_counted:
            self.shed.append("completion_over_max_counted_bytes")  # about 1 s of tokenizer per 4 MiB
            counts = None
        else:
            counts = count_completion(texts, tok, first_only) if tok is not None else None
        prompt = None
        if tok is not None and request.parts is not None and over_max_counted_items(request.parts):
            self.shed.append("prompt_over_max_counted_items")  # work per message, as max_counted is per byte
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
                and not texts.unparsed and self.status is not None and self.status < 400 and not self.capped):
            completion = 0  # a tokenizer and a successful answer read with no text: truly zero tokens
        decode_tps = None
        if counts and decode and decode > 0:
            decode_tps = (counts["completion"] - counts["first"]) / decode
        if streamed:  # what the per-chunk metrics need, handed beside the record (chunk_gaps.py)
            # bucketed by the C scans already, else (every other path) from when the chunks arrived
            gaps = texts.gaps if texts.gaps is not None else gap_buckets(texts.chunk_times, texts.chunk_counts)
            self.timing = StreamTiming(texts.t_first_event - t_req if texts.t_first_event is not None else None,
                                       gaps[0] if gaps else None, gaps[1] if gaps else 0.0)
        delays = sorted(map(sub, self.write_times, self.read_times))  # per read: write done - read
        client = client_of(self.headers, self.client_header)
        session = session_of(client, request.model, request.parts)
        turn = TurnPrefix()
        if prefixes is not None:
            try:
                turn = prefixes.observe(session, tok if prompt is not None else None, request.parts)
            except Exception as exc:  # the comparison's figures are null; the turn keeps the rest
                FAILURES.note("comparing the prompt with the previous turn failed, its figures null", exc)
        # the tools this turn's answer called: unknown when no response came or its body could not be read
        read = self.t_upstream_headers is not None and texts.unreadable is None
        tools_defined, tools_called, names = tool_names(request.parts, texts.calls if read else None, self.store_text)
        response_text = None
        if self.store_text and texts.texts:
            response_text = "".join(texts.texts[k] for k in sorted(texts.texts))
        return self._make(
            api=api.name,
            client=client,
            session=session,
            prefix_reused_tokens=turn.reused,
            prefix_break_part=turn.part,
            prompt_block_digests=turn.blocks,
            turn_diff=orjson.dumps(turn.diff).decode() if turn.diff is not None else None,
            tools_defined=tools_defined,
            tools_called=tools_called,
            tool_names=names,
            outcome=outcome,
            error=self.error
            or framing_error
            or texts.error
            or (f"{texts.bad_events} stream events were not JSON" if texts.bad_events else None)
            or (texts.unreadable if self.status is not None and self.status < 400 else None),
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
            chunks=texts.chunks if (texts.chunks or self.status is not None) else None,
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
            prompt_text=self.body.decode("utf-8", "replace") if self.store_text else None,
            response_text=response_text,
        )

    def unmeasured(self, error: str) -> Record:
        """The row of a turn whose measuring failed (``build`` raised): what the forwarding path knew,
        nothing derived, so the turn is still counted. ``error`` says where it failed, never what was sent."""
        return self._make(
            outcome="proxy_error",
            error=f"{error}; forwarding outcome {self.outcome}"[:300],
            response_bytes=self.kept_bytes,
        )

    def _capped_reason(self) -> str | None:
        why = []
        if self.capped:
            why.append("response_memory_budget" if self.budget_capped else "response_over_max_measured_bytes")
        why.extend(self.shed)
        return ",".join(why) if why else None

    def _make(self, **derived) -> Record:
        """The one place a turn's Record is constructed: what the forwarding path stamped, plus
        ``derived`` (what ``_record`` read from the bytes, or what ``unmeasured`` could say)."""
        return Record(
            id=self.id,
            t_wall=self.t_wall,
            method=self.method,
            path=self.path,
            status=self.status,
            label=self.label,
            proxy_name=self.proxy_name,
            tenant=self.tenant_rule.of(self.headers) if self.tenant_rule is not None else None,
            instance_id=self.instance_id,
            concurrency=self.concurrency,
            conn_id=self.conn_id,
            t_request=self.t_request,
            t_upstream_headers=self.t_upstream_headers,
            t_done=self.t_done,
            total_s=self.t_done - self.t_request if self.t_done is not None else None,
            request_bytes=self.request_bytes,
            measure_capped=self.measured and (self.capped or bool(self.shed)),
            measure_capped_reason=self._capped_reason() if self.measured else None,
            **derived,
        )


SMALL_KEEP = 64 * 1024  # wire/memory.py's: a turn's first bytes kept may use the whole budget


def _no_budget(n: int, small: bool = False) -> bool:
    return True


def _median_sorted(values: list[float]) -> float:
    """``statistics.median`` of an already sorted, non-empty list, without its per-call overhead."""
    mid = len(values) // 2
    return values[mid] if len(values) & 1 else (values[mid - 1] + values[mid]) / 2
