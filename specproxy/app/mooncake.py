"""Mooncake traces: written by ``export --format mooncake``, read by ``bench --from FILE``.

Why this format: AIPerf, SGLang's benchmark, GuideLLM and Dynamo's tools replay it, and it holds no text,
so production traffic can be replayed elsewhere without leaving the building as prompts. A line is one
request::

    {"timestamp": 1520, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 14]}

``timestamp``: milliseconds since the trace's first request; ``input_length`` and ``output_length``: prompt
and output tokens; ``hash_ids``: one id per ``block_size`` prompt tokens (the last block may be partial),
equal for two requests exactly when their prompts hold the same tokens from the start to that block's end
(a block's id depends on every block before it), numbered from 0 in order of first appearance.

specproxy writes them from each turn's stored block digests (``measure/blocks.py``), and reads them back
into requests whose prompts share blocks exactly as the ids say (``synth.py``), sent at their recorded
offsets (docs/bench.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from specproxy.app.replay import CHAT, Request
from specproxy.errors import ConfigError
from specproxy.measure.blocks import BLOCK_TOKENS, block_ids, split_digests

__all__ = ["TRACE_FIELDS", "TraceRequest", "file_is_trace", "is_trace_line", "read_trace", "trace_lines",
           "trace_requests"]

TRACE_FIELDS = ("t_wall", "prompt_tokens", "completion_tokens", "usage_completion_tokens", "prompt_block_digests")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    where: str = ""


def check_block_size(block_size: int) -> None:
    if block_size <= 0 or block_size % BLOCK_TOKENS:
        raise ConfigError(f"--block-size must be a positive multiple of {BLOCK_TOKENS} (the stored blocks' size), "
                          f"got {block_size}")


def trace_lines(rows: Iterable[tuple], block_size: int, skipped: list[int]) -> Iterator[bytes]:
    """The Mooncake lines of turns given as ``TRACE_FIELDS`` tuples, oldest first. A turn without block
    digests (measured without a tokenizer, or before they were recorded) or without an output count is
    left out and counted in ``skipped[0]``: a trace line without them would claim blocks it cannot name."""
    check_block_size(block_size)
    numbers: dict[str, int] = {}
    first = None
    for t_wall, prompt_tokens, completion_tokens, usage_completion, digests in rows:
        output = completion_tokens if completion_tokens is not None else usage_completion
        if not digests or prompt_tokens is None or output is None or t_wall is None:
            skipped[0] += 1
            continue
        first = t_wall if first is None else first
        ids = [numbers.setdefault(d, len(numbers)) for d in block_ids(split_digests(digests), block_size)]
        yield orjson.dumps({"timestamp": round((t_wall - first) * 1000), "input_length": int(prompt_tokens),
                            "output_length": int(output), "hash_ids": ids}) + b"\n"


def is_trace_line(obj: object) -> bool:
    """Whether a parsed line is a Mooncake request (not a request body or a replay wrapper)."""
    return isinstance(obj, dict) and ("hash_ids" in obj or "input_length" in obj) and not (
        {"messages", "prompt", "input", "body", "body_b64"} & obj.keys())


def _whole(obj: dict, key: str, where: str, *, required: bool) -> int | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: \"{key}\" must be a whole number of at least 0, got {value!r}")
    return value


def parse_trace_line(obj: dict, where: str) -> TraceRequest:
    timestamp = obj.get("timestamp", 0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise ConfigError(f"{where}: \"timestamp\" must be milliseconds of at least 0, got {timestamp!r}")
    inp = _whole(obj, "input_length", where, required=True)
    out = _whole(obj, "output_length", where, required=False)
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                 for h in hash_ids):
        raise ConfigError(f"{where}: \"hash_ids\" must be a list of whole numbers of at least 0")
    if out is None or out < 1:
        raise ConfigError(f"{where}: \"output_length\" must be at least 1 (the tokens to ask for), got {out!r}")
    return TraceRequest(float(timestamp), inp, out, tuple(hash_ids), where)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a Mooncake trace file, ordered by timestamp (stable). ConfigError, naming the file
    and line, for anything that is not one."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        if not is_trace_line(obj):
            raise ConfigError(f"{where}: not a Mooncake trace line (expected \"timestamp\", \"input_length\", "
                              "\"output_length\" and \"hash_ids\"), though the file's first line is one")
        out.append(parse_trace_line(obj, where))
    if not out:
        raise ConfigError(f"{p}: no requests in the file")
    return sorted(out, key=lambda r: r.timestamp_ms)


def file_is_trace(path: str | Path) -> bool:
    """Whether a replay file's first line is a Mooncake request (then the whole file is read as a trace)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    try:
                        return is_trace_line(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        return False
    except OSError:
        return False  # the replay reader says why in one line
    return False


def _chat(model: str | None, text: str, max_tokens: int) -> bytes:
    body: dict[str, object] = {} if model is None else {"model": model}
    body.update(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, ignore_eos=True)
    return orjson.dumps(body)


def trace_requests(trace: list[TraceRequest], tok, block_size: int, model: str | None,
                   seed: int = 0) -> tuple[list[Request], Request]:
    """The trace as chat completions requests (streamed, ``max_tokens`` = ``output_length`` with
    ``ignore_eos``, one user message of ``input_length`` tokens whose blocks are the hash ids' blocks), each
    with its recorded offset; and a warm-up request of as many tokens as the first, sharing no block."""
    from specproxy.app.synth import BlockText

    check_block_size_of_trace(block_size)
    blocks = BlockText(tok, block_size, seed)
    first = trace[0].timestamp_ms
    out = [Request(CHAT, _chat(model, blocks.prompt(r.hash_ids, r.input_length, i), r.output_length), "", r.where,
                   offset_s=(r.timestamp_ms - first) / 1000) for i, r in enumerate(trace)]
    warm = Request(CHAT, _chat(model, "".join(blocks.filler("warm-up", max(trace[0].input_length, 1))), 1), "",
                   "the warm-up (no block of the trace)")
    return out, warm


def check_block_size_of_trace(block_size: int) -> None:
    if block_size <= 0:
        raise ConfigError(f"--block-size must be at least 1, got {block_size}")
