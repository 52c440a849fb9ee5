"""Replay files: request bodies, one JSON object a line, read for ``bench`` and written by ``export``.

Why two shapes of line: a file written by hand is most naturally the request bodies themselves
(``{"model": ..., "messages": [...]}``), while a captured body must come back byte for byte (the
8k-token prefix a client sends, with its own key order and spacing, possibly not one line), which
only a string can hold. So a line is either:

* a request body of any API specproxy measures, its path inferred from its fields (``infer_path``);
  the bytes sent are the line's own, without its line end;
* a wrapper ``{"path": "/v1/chat/completions", "body": "<the body, as a JSON string>"}``: the bytes
  sent are the string's UTF-8; ``"body"`` may also be an object (sent as compact JSON), and a body that
  is not UTF-8, or was sent compressed, is ``"body_b64"`` (with its ``"content_encoding"``).
  ``path`` may be any path specproxy measures; without it, it is inferred as for a bare body. An optional
  ``"timestamp"`` (milliseconds from the file's first request; ``export --format replay`` writes it) is
  when ``bench --timing recorded`` sends it.

A file whose first line is a Mooncake trace line is read as a trace instead (``mooncake.py``).

Every way a line can be wrong is said as one line naming the file and line number.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from specproxy.errors import ConfigError
from specproxy.measure.apis import is_measured
from specproxy.store.captures import Captured

__all__ = ["Request", "infer_path", "read_replay_file", "replay_line", "requests_from_captures"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"


@dataclass(frozen=True, slots=True)
class Request:
    """One request to send: the path, the body's bytes exactly, and the Content-Encoding they are in."""

    path: str
    body: bytes
    content_encoding: str = ""
    where: str = ""  # "FILE:LINE" or "captured turn ID", for messages
    fresh: bool = False  # a probe's: its nonce is replaced by a new random word at each send (probes.py)
    offset_s: float | None = None  # when it was sent, from the first request (``bench --timing recorded``)

    def json(self) -> dict | None:
        """The body parsed, or None (compressed, or not a JSON object)."""
        if self.content_encoding:
            return None
        try:
            obj = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None


# What only one API's body has. A chat message may carry role system, developer or tool, tool calls, and
# parts an Anthropic message cannot; an Anthropic body may carry a top-level system prompt, its
# version, stop sequences, tools with an input_schema, and content blocks chat has no word for.
_CHAT_ROLES = frozenset({"system", "developer", "tool", "function"})
_CHAT_MESSAGE_KEYS = frozenset({"tool_calls", "tool_call_id", "function_call", "refusal"})
_CHAT_PARTS = frozenset({"image_url", "input_audio", "file", "refusal"})
_MESSAGES_TOP = frozenset({"system", "anthropic_version", "stop_sequences"})
_MESSAGES_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document", "image",
                              "server_tool_use", "web_search_tool_result", "search_result"})


def _api_signs(obj: dict) -> tuple[str | None, str | None]:
    """(the first thing in a ``messages`` body that only chat completions has, the first that only the
    Anthropic Messages API has), each None when there is none."""
    chat = messages = None
    found = [k for k in _MESSAGES_TOP if k in obj]
    if found:
        messages = f'top-level "{sorted(found)[0]}"'
    tools = obj.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            if isinstance(tool, dict) and "input_schema" in tool and messages is None:
                messages = 'a tool with "input_schema"'
            if isinstance(tool, dict) and "function" in tool and chat is None:
                chat = 'a tool with "function"'
    for msg in obj["messages"] if isinstance(obj["messages"], list) else ():
        if not isinstance(msg, dict):
            continue
        if chat is None and msg.get("role") in _CHAT_ROLES:
            chat = f'a message with role "{msg["role"]}"'
        if chat is None and _CHAT_MESSAGE_KEYS & msg.keys():
            chat = f'a message with "{sorted(_CHAT_MESSAGE_KEYS & msg.keys())[0]}"'
        content = msg.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if chat is None and kind in _CHAT_PARTS:
                chat = f'a "{kind}" part'
            if messages is None and (kind in _MESSAGES_BLOCKS or (isinstance(part, dict) and "cache_control" in part)):
                messages = f'a "{kind}" block' if kind in _MESSAGES_BLOCKS else 'a block with "cache_control"'
    return chat, messages


def infer_path(obj: dict) -> str:
    """The path a bare request body is sent to, from the fields only one API has; ConfigError (to be
    completed into a sentence by the caller: "the body " + message) when it has none or signs of two APIs.

    The rule (docs/bench.md): ``prompt`` is a completion, ``input`` a Responses request; ``messages`` is
    an Anthropic Messages request when it has something only that API has (a top-level ``system``,
    ``anthropic_version`` or ``stop_sequences``, a tool with ``input_schema``, a ``tool_use``,
    ``tool_result``, ``thinking``, ``image`` or ``document`` block, a block with ``cache_control``), else
    a chat completion. A body both APIs accept as it is (user and assistant turns of plain text, with
    ``max_tokens``) is sent as a chat completion: the wrapper's ``"path"`` says otherwise."""
    keys = [k for k in ("messages", "prompt", "input") if k in obj]
    if not keys:
        raise ConfigError('has none of "messages" (chat completions, Anthropic Messages), "prompt" (completions) '
                          'and "input" (Responses)')
    if len(keys) > 1:
        raise ConfigError(f'has both "{keys[0]}" and "{keys[1]}": {_NAME_IT}')
    if keys[0] == "prompt":
        return COMPLETIONS
    if keys[0] == "input":
        return RESPONSES
    chat, messages = _api_signs(obj)
    if chat and messages:
        raise ConfigError(f"has {chat} (chat completions) and {messages} (Anthropic Messages): {_NAME_IT}")
    return MESSAGES if messages else CHAT


_NAME_IT = f'write it as {{"path": "{MESSAGES}", "body": ...}} (or whichever path it is for) to say which API'
_NOT_A_REQUEST = ('not a request: expected a request body (an object with "messages", "prompt" or "input") or '
                  '{"path": ..., "body": ...}')
_WRAP = 'or write {"path": ..., "body": ...}'


def parse_line(raw: bytes, where: str) -> Request:
    """One line of a replay file (without its line end) as a Request; ConfigError says why not."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: {_NOT_A_REQUEST}")
    if "body" not in obj and "body_b64" not in obj:
        try:
            return Request(infer_path(obj), raw, "", where)
        except ConfigError as exc:
            lead = "not a request: the object" if "none of" in str(exc) else "the body"
            raise ConfigError(f"{where}: {lead} {exc}" + (f" ({_WRAP})" if "none of" in str(exc) else "")) from None
    encoding = obj.get("content_encoding") or ""
    if not isinstance(encoding, str):
        raise ConfigError(f"{where}: \"content_encoding\" must be a string")
    if "body_b64" in obj:
        try:
            body = base64.b64decode(obj["body_b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ConfigError(f"{where}: \"body_b64\" is not base64") from None
    elif isinstance(obj["body"], str):
        body = obj["body"].encode("utf-8", "surrogatepass")
    elif isinstance(obj["body"], dict):
        body = orjson.dumps(obj["body"])
    else:
        raise ConfigError(f"{where}: \"body\" must be a string (the body as sent) or an object")
    inner = None
    if not encoding:
        try:
            inner = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise ConfigError(f"{where}: the body is not JSON") from None
        if not isinstance(inner, dict):
            raise ConfigError(f"{where}: the body is not a JSON object")
    path = obj.get("path")
    if path is None:
        if inner is None:
            raise ConfigError(f"{where}: no \"path\", and a compressed body cannot say which API it is for")
        try:
            path = infer_path(inner)
        except ConfigError as exc:
            raise ConfigError(f"{where}: no \"path\", and the body {exc}") from None
    if not isinstance(path, str) or not is_measured("POST", path):
        raise ConfigError(f"{where}: path {path!r} is not one specproxy measures (e.g. {CHAT}, {COMPLETIONS}, "
                          f"{MESSAGES}, {RESPONSES})")
    timestamp = obj.get("timestamp")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, (int, float))
                                  or timestamp < 0):
        raise ConfigError(f"{where}: \"timestamp\" must be milliseconds of at least 0, got {timestamp!r}")
    return Request(path, body, encoding, where, offset_s=None if timestamp is None else timestamp / 1000)


def read_replay_file(path: str | Path) -> list[Request]:
    """Every request of a replay file, in order; blank lines are skipped. ConfigError for a file that
    cannot be read, a bad line, or a file with no request."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    requests = list(_lines(data, str(p)))
    if not requests:
        raise ConfigError(f"{p}: no requests in the file")
    return requests


def _lines(data: bytes, name: str) -> Iterator[Request]:
    for number, line in enumerate(data.split(b"\n"), 1):
        line = line.rstrip(b"\r")
        if line.strip():
            yield parse_line(line, f"{name}:{number}")


def requests_from_captures(captures: Iterable[Captured]) -> list[Request]:
    """Captured bodies as Requests, byte for byte, with their offsets from the first (``bench --from
    captured``)."""
    kept = [c for c in captures if is_measured(c.method, c.path)]
    first = kept[0].t_wall if kept else 0.0
    return [Request(c.path, c.body, c.content_encoding, f"captured turn {c.turn_id}", offset_s=c.t_wall - first)
            for c in kept]


def replay_line(c: Captured, first_t_wall: float | None = None) -> bytes:
    """One line of ``export --format replay``: a wrapper whose body comes back as the same bytes, and
    (given the first exported request's ``t_wall``) its ``timestamp``, in ms from that one."""
    out: dict[str, object] = {"path": c.path}
    if first_t_wall is not None:
        out["timestamp"] = round((c.t_wall - first_t_wall) * 1000)
    text = None
    if not c.content_encoding:
        try:
            text = c.body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is not None:
        out["body"] = text
    else:
        out["body_b64"] = base64.b64encode(c.body).decode("ascii")
        if c.content_encoding:
            out["content_encoding"] = c.content_encoding
    return orjson.dumps(out) + b"\n"
