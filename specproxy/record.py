"""The one schema: a ``Record`` is one turn as specproxy measured it.

Why one frozen record: the proxy (passive traffic) and the benchmark (active traffic) build the same
record through the same ``TurnRecorder`` and ``build_record`` (``measure/turn_recorder.py``, ``measure/build.py``),
so reports cannot tell them apart. Names and
meanings follow docs/metrics.md exactly; each field's docstring below is its definition, and the
store's columns, ``export`` and the docs are generated from this list.

Times named ``t_*`` are seconds on the monotonic clock (``time.perf_counter``) of the proxy process,
taken when bytes crossed a socket; they order events within one proxy run and are meaningless across
runs. ``t_wall`` (UTC epoch seconds) only dates the turn.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import MISSING, dataclass, fields
from typing import Any

from specproxy.fielddocs import field_docs

__all__ = ["FIELD_DOCS", "OUTCOMES", "Record", "new_conn_id", "new_turn_id"]


_ID_PREFIX = os.urandom(8).hex()  # the random part of this process's turn ids
_ID_COUNT = itertools.count()
# connection ids: a random base per process (20 bits above a 32-bit counter: exact in a float64 column)
_CONN_COUNT = itertools.count(int.from_bytes(os.urandom(3), "big") % (1 << 20) << 32)


def _reseed() -> None:
    global _ID_PREFIX, _ID_COUNT, _CONN_COUNT
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNT = itertools.count()
    _CONN_COUNT = itertools.count(int.from_bytes(os.urandom(3), "big") % (1 << 20) << 32)


os.register_at_fork(after_in_child=_reseed)  # a forked worker must not repeat its parent's ids


def new_turn_id() -> str:
    """32 hex digits: 16 random ones drawn once per process, then a counter. Unique across processes and
    restarts like a random id, without a ``getrandom`` system call per turn on the event loop (uuid4
    made one); thread-safe (``next`` on a count is atomic under the interpreter lock)."""
    return f"{_ID_PREFIX}{next(_ID_COUNT):016x}"


def new_conn_id() -> int:
    """A ``conn_id``: unique within this process, and two processes' ids differ but for a chance of
    about one in a million per pair (their random bases); an integer below 2**52, no address in it."""
    return next(_CONN_COUNT)

OUTCOMES = (
    "ok",  # the upstream answered and the stream ended normally
    "upstream_error",  # the upstream answered with a 4xx/5xx status (forwarded verbatim)
    "upstream_unreachable",  # refused or reset before response headers (the client got a 502)
    "upstream_timeout",  # no connection, or no response headers, in time (the client got a 504)
    "upstream_truncated",  # the upstream died mid-body: the client's stream was aborted too
    "client_abort",  # the client went away before the response ended; counts are partial
    "shutdown",  # specproxy's shutdown cut it (its drain limit passed, or a second Ctrl-C); counts are partial
    "client_stalled",  # the client took no bytes for send_timeout_s: cut by the proxy; counts are partial
    "proxy_error",  # specproxy itself failed (a bug): the record says what
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One measured turn. A field is ``None`` when it could not be measured, never 0 instead."""

    id: str
    """Hex id of the turn, unique across proxy processes and restarts (32 digits: a random part drawn once
    per process, then a counter)."""
    t_wall: float
    """UTC epoch seconds when the request arrived (dates the turn; never used for durations)."""
    method: str
    """HTTP method of the request."""
    path: str
    """Request path without the query string, e.g. ``/v1/chat/completions``."""
    api: str | None = None
    """Which API the turn spoke: ``chat`` (chat completions), ``completions``, ``messages`` (the
    Anthropic Messages API) or ``responses`` (the OpenAI Responses API); null on rows recorded before
    specproxy told them apart (all were chat or completions)."""
    client: str | None = None
    """The client, as its ``User-Agent`` request header names it (at most 200 characters), or null."""
    session: str | None = None
    """Which conversation the turn extends: 16 hex digits of a digest of the client, the model and the
    conversation's first message (turns of one conversation resend it); null without a conversation. No
    text is kept: two conversations that open with the same message are one session."""
    status: int | None
    """HTTP status the client received (502 when the upstream refused or reset the connection, 504 when it
    timed out, before answering)."""
    outcome: str
    """One of ``ok``, ``upstream_error``, ``upstream_unreachable``, ``upstream_timeout``,
    ``upstream_truncated``, ``client_abort``, ``client_stalled`` (the client took no bytes of the response for
    ``send_timeout_s``: the proxy cut it), ``shutdown`` (cut by specproxy's own shutdown: its drain limit
    passed, or a second Ctrl-C), ``proxy_error``."""
    error: str | None = None
    """A short description of what went wrong, when something did (never contains request text)."""
    streamed: bool = False
    """The response was a server-sent-event stream."""
    model: str | None = None
    """The ``model`` the request asked for."""
    label: str | None = None
    """The arm of an A/B comparison: from the ``X-Specproxy-Label`` request header or the config."""
    instance_id: str | None = None
    """The upstream server instance (changes when the server restarts) when known."""
    request_parsed: bool = False
    """The request body was valid JSON that specproxy could read (it is forwarded unchanged either way)."""
    concurrency: int = 1
    """Measured requests in flight through the proxy to the upstream when this one started, itself included."""
    conn_id: int | None = None
    """The client connection the request came on: turns of one kept-alive connection share it (one
    connection carries one turn at a time, so they are a serial chain: ``compare``'s lanes). An integer
    unique within a proxy process (a random base drawn once per process plus a counter, so two
    processes' connections differ too); it holds no address or port. ``specproxy bench`` gives each
    closed-loop worker its own connection per round. Null when unknown (rows recorded before it)."""
    t_request: float | None = None
    """Monotonic seconds: the proxy had read the whole request body from the client."""
    t_upstream_headers: float | None = None
    """Monotonic seconds: the upstream's response headers arrived."""
    t_first_token: float | None = None
    """Monotonic seconds: the first upstream chunk carrying output text (content, reasoning or
    tool-call arguments) arrived; a role-only or empty delta is not a token."""
    t_last_token: float | None = None
    """Monotonic seconds: the last upstream chunk carrying output text arrived."""
    t_done: float | None = None
    """Monotonic seconds: the upstream response ended (``[DONE]`` or the end of the body)."""
    ttft_s: float | None = None
    """``t_first_token - t_request``."""
    decode_s: float | None = None
    """``t_last_token - t_first_token``."""
    total_s: float | None = None
    """``t_done - t_request``."""
    completion_tokens: int | None = None
    """Tokens of the delivered output (content + reasoning + tool-call arguments), counted by the
    model's tokenizer over the whole delivered text. Never the number of chunks."""
    content_tokens: int | None = None
    """The part of ``completion_tokens`` that was ``content`` (or a completion's ``text``)."""
    reasoning_tokens: int | None = None
    """The part of ``completion_tokens`` that was ``reasoning_content`` / ``reasoning``."""
    tool_args_tokens: int | None = None
    """The part of ``completion_tokens`` that was tool-call arguments."""
    content_class: str | None = None
    """What the delivered output was: ``code``, ``prose`` or ``tool_call`` (classified from the text,
    see ``content.py``), null when nothing was delivered. Acceptance differs by class, so reports
    keep the classes apart."""
    first_chunk_tokens: int | None = None
    """Tokens complete once the first text-carrying chunk had arrived (excluded from ``decode_tps``)."""
    usage_completion_tokens: int | None = None
    """What the server's own ``usage.completion_tokens`` said (the last one sent), or null. It may
    count tokens the client never saw as text (an end-of-turn token); kept beside ours, never instead."""
    usage_prompt_tokens: int | None = None
    """What the server's own ``usage.prompt_tokens`` said, or null (Messages: ``input_tokens`` +
    ``cache_read_input_tokens`` + ``cache_creation_input_tokens``; Responses: ``input_tokens``)."""
    usage_cached_tokens: int | None = None
    """The server's own count of prompt tokens it took from its prefix cache, or null: chat's
    ``usage.prompt_tokens_details.cached_tokens``, Messages' ``cache_read_input_tokens``, Responses'
    ``input_tokens_details.cached_tokens``; llama.cpp's ``timings.cache_n`` when its usage has no cached
    count (llama-server sends ``timings`` on a stream without ``stream_options.include_usage`` too, and
    then no usage at all). Cache reads only: writes are ``usage_cache_write_tokens``."""
    chunks: int | None = None
    """Stream events that carried output text (1 for a non-streamed response with text)."""
    tokens_per_chunk: float | None = None
    """``completion_tokens / chunks``: tokens per decoding step on a server that streams once per
    step (~1.0 without speculative decoding, the mean acceptance length with it)."""
    decode_tps: float | None = None
    """Per-stream decode speed: ``(completion_tokens - first_chunk_tokens) / decode_s``; null when
    ``decode_s`` is 0 (a single chunk, or a non-streamed response)."""
    prompt_tokens: int | None = None
    """Tokens of the prompt as the server sees it: the chat template applied to messages and tools
    when the tokenizer has one, else the sum of the four parts."""
    prompt_system_tokens: int | None = None
    """Part of ``prompt_tokens``: system/developer messages (and template text no message wraps)."""
    prompt_tools_tokens: int | None = None
    """Part of ``prompt_tokens``: tool and function definitions."""
    prompt_history_tokens: int | None = None
    """Part of ``prompt_tokens``: the conversation before this turn's new input."""
    prompt_new_tokens: int | None = None
    """Part of ``prompt_tokens``: this turn's new input (the newest user message, or an agent's tool
    results), with the generation prompt."""
    proxy_delay_s: float | None = None
    """Time the proxy itself added: the median over reads of (written to client - read from upstream)."""
    request_bytes: int | None = None
    """Size of the request body."""
    response_bytes: int | None = None
    """Bytes of response body relayed to the client."""
    saw_done: bool | None = None
    """A streamed response carried the ``data: [DONE]`` marker (null when not streamed)."""
    finish_reason: str | None = None
    """The last ``finish_reason`` the server gave."""
    server_timings: str | None = None
    """JSON of the server's own per-request accounting when it sends one (llama.cpp ``timings``:
    prompt_n, prompt_ms, predicted_n, predicted_ms, draft_n, draft_n_accepted)."""
    tokenizer: str | None = None
    """The tokenizer that counted, e.g. ``hf:/models/llama`` or ``tiktoken:o200k_base``; null: no counts."""
    prompt_text: str | None = None
    """The request body as text: stored only with ``--store-text`` (opt-in)."""
    response_text: str | None = None
    """The delivered output text: stored only with ``--store-text`` (opt-in)."""
    measure_capped: bool = False
    """The response body was longer than ``max_measured_bytes``: the client got all of it, but only its
    first reads (within that many bytes) were kept and measured, so every figure taken from the body
    (texts, tokens, chunks, ``t_last_token``, ``response_bytes``, ``saw_done``) covers that part alone.
    Also true when the turn was measured less for another reason: ``measure_capped_reason`` says which."""
    measure_capped_reason: str | None = None
    """Why the turn was measured less than whole (null when it was not), comma-separated:
    ``response_over_max_measured_bytes`` (the body past ``max_measured_bytes`` was relayed, not kept),
    ``response_memory_budget`` (the process's ``memory_budget_bytes`` had no room for more of the body),
    ``prompt_memory_budget`` (the request body was let go of before measuring, to stay within the budget:
    the prompt is not counted, ``usage_prompt_tokens`` is the server's own), ``prompt_over_max_counted_bytes``
    and ``completion_over_max_counted_bytes`` (too large for the tokenizer to count: their token counts are
    null), ``prompt_over_max_counted_items`` (more messages and tool definitions than are counted: the
    prompt's token counts are null), ``response_over_max_counted_bytes`` (a whole, not streamed, response
    body over ``max_counted_bytes`` was not parsed, as parsing takes about three times its size: its
    text's figures are null, and the server's ``usage`` and ``timings`` were read by a byte search for
    their one key each)."""

    measured: bool = True
    """The path is one specproxy measures (a generation endpoint). False: any other path (``GET
    /v1/models``, ``/health``...), forwarded untouched and recorded with its method, path, status,
    timings (``t_request``, ``t_upstream_headers``, ``t_done``, ``total_s``) and outcome only; reports
    keep their figures over measured turns and count these apart."""
    prefix_reused_tokens: int | None = None
    """How many tokens at the start of this turn's prompt (as counted for ``prompt_tokens``) are the same
    tokens as at the start of the same session's previous turn: what a server's prefix cache could reuse.
    Equal to ``prompt_tokens`` less this turn's additions when the client only appended; smaller when it
    changed something earlier (the system prompt, the tools, a past message). Null on a session's first
    turn, without a session or a tokenizer, or when the previous turn is no longer remembered."""
    prefix_break_part: str | None = None
    """Which part of the prompt the first differing token of ``prefix_reused_tokens`` falls in:
    ``system``, ``tools``, ``history`` or ``new``; null when the turn only appended to the previous
    one, or when the tokenizer renders a chat template (its render does not keep the parts in order)."""
    turn_diff: str | None = None
    """JSON of what changed since the same session's previous turn, from digests (no text kept):
    ``messages_added``, ``messages_removed`` (past messages no longer at the same place: dropped,
    edited or compacted), ``system_changed``, ``tools_changed``; null on a session's first turn."""
    tools_defined: int | None = None
    """Tools (functions) the request defined; null when the request could not be read."""
    tools_called: int | None = None
    """Distinct tools this turn's delivered output called (read from the response: chat ``tool_calls``
    or ``function_call``, Messages ``tool_use`` blocks, Responses ``function_call`` items; one tool called
    twice is one); 0 when it called none; null when no response came or its body could not be read."""
    tool_names: str | None = None
    """JSON ``{"defined": [...], "called": [...]}``: the names of the tools the request defined and of
    those this turn's output called (first call first), with ``--store-text``; else 12 hex digits of a
    digest of each name (enough to tell which defined tools were called, without the names).
    ``defined`` is left out when the request could not be read, ``called`` when the response could not;
    null when neither has a name."""
    usage_cache_write_tokens: int | None = None
    """The server's own count of prompt tokens it wrote to its prompt cache on this turn (a cache write,
    which the APIs that charge for caching price apart from a read), or null when the server says nothing:
    Messages' ``usage.cache_creation_input_tokens``, Responses' ``input_tokens_details.cache_write_tokens``,
    chat's ``prompt_tokens_details.cache_write_tokens``. vLLM, llama.cpp and OpenAI send none (null there)."""
    tenant: str | None = None
    """Whose turn it is (a team, a customer): the value of the request header Config ``tenant_header``
    names (at most 200 characters), or with ``tenant_from_key`` ``key:`` and 16 hex digits of a keyed
    hash (HMAC-SHA256 under a secret kept in this database, or the fleet's shared one, Config
    ``tenant_secret_file``, never stored) of the request's API key, never the key; null when neither is set, the request has no such header or key, or on rows recorded before it."""
    prompt_block_digests: str | None = None
    """The prompt's token blocks as chained digests, no text: 16 hex digits per block of 64 tokens (of
    the prompt as counted for ``prompt_tokens``; the last block may be shorter), each a BLAKE2b digest
    of the block's token ids and the previous block's digest, so two turns' digests agree up to the
    block where their prompts first differ. ``export --format mooncake`` reads its hash ids from them
    (docs/bench.md). Null without a tokenizer, or when the prompt was not counted."""
    proxy_name: str | None = None
    """The proxy that saw the turn: Config ``proxy_name`` (the host name unless set), so that turns
    shipped from many proxies to one database (a fleet, docs/operations.md) can be told apart; null on
    rows recorded before it (a sink ships them under the proxy's name of the day)."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELD_NAMES}


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Record))


def _slot_setting_init(cls: type) -> None:
    """Give a frozen, slotted, keyword-only dataclass an ``__init__`` that sets each slot through its own
    descriptor. Why: the one dataclasses generates for a frozen class calls ``object.__setattr__`` for each
    field (its ``__setattr__`` refuses), ~9 µs for Record's 64 fields, once a turn on the measuring thread;
    each slot's own setter does the same assignment in ~2/3 of the time. Same signature, defaults and
    errors (a missing or unknown keyword, a positional argument); the class stays frozen."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: a __post_init__ is not supported here")
    params, lines, names = [], [], {}
    for f in fields(cls):
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: a field outside __init__ is not supported here")
        names[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is not MISSING:
            names[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a default factory is not supported here")
        else:
            params.append(f.name)
        lines.append(f"    _set_{f.name}(self, {f.name})")
    exec(f"def __init__(self, *, {', '.join(params)}):\n" + "\n".join(lines), names)  # the names are the class's own fields
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init


_slot_setting_init(Record)


FIELD_DOCS: dict[str, str] = field_docs(Record)
