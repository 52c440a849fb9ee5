"""Replay files: request bodies, one JSON object a line, read for ``bench`` and written by ``export``.

Why two shapes of line: a file written by hand is most naturally the request bodies themselves
(``{"model": ..., "messages": [...]}``), while a captured body must come back byte for byte (the
8k-token prefix a client sends, with its own key order and spacing, possibly not one line), which
only a string can hold. So a line is either:

* a request body: a chat completion (has ``messages``) or a completion (has ``prompt``); the bytes
  sent are the line's own, without its line end;
* a wrapper ``{"path": "/v1/chat/completions", "body": "<the body, as a JSON string>"}``: the bytes
  sent are the string's UTF-8; ``"body"`` may also be an object (sent as compact JSON), and a body that
  is not UTF-8, or was sent compressed, is ``"body_b64"`` (with its ``"content_encoding"``).
  ``path`` may be any path specproxy measures; without it, it is inferred as for a bare body.

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
from specproxy.measure.builder import is_measured
from specproxy.store.captures import Captured

__all__ = ["Request", "read_replay_file", "replay_line", "requests_from_captures"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Request:
    """One request to send: the path, the body's bytes exactly, and the Content-Encoding they are in."""

    path: str
    body: bytes
    content_encoding: str = ""
    where: str = ""  # "FILE:LINE" or "captured turn ID", for messages
    fresh: bool = False  # a probe's: its nonce is replaced by a new random word at each send (probes.py)

    def json(self) -> dict | None:
        """The body parsed, or None (compressed, or not a JSON object)."""
        if self.content_encoding:
            return None
        try:
            obj = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None

    def with_fields(self, **fields: object) -> Request:
        """The same request with body fields set (a phase probe's max_tokens, stream): re-serialised, so no
        longer byte for byte the original. Raises ConfigError for a body that is not a JSON object."""
        obj = self.json()
        if obj is None:
            raise ConfigError(f"{self.where}: the body is not a JSON object, so it cannot be changed for a phase probe")
        return Request(self.path, orjson.dumps({**obj, **fields}), "", self.where)


def _infer_path(obj: dict) -> str | None:
    if "messages" in obj:
        return CHAT
    if "prompt" in obj:
        return COMPLETIONS
    return None


_NOT_A_REQUEST = ("not a request: expected a request body (an object with \"messages\" or \"prompt\") or "
                  "{\"path\": ..., \"body\": ...}")


def parse_line(raw: bytes, where: str) -> Request:
    """One line of a replay file (without its line end) as a Request; ConfigError says why not."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: {_NOT_A_REQUEST}")
    if "body" not in obj and "body_b64" not in obj:
        path = _infer_path(obj)
        if path is None:
            raise ConfigError(f"{where}: {_NOT_A_REQUEST}")
        return Request(path, raw, "", where)
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
        path = _infer_path(inner) if inner is not None else None
        if path is None:
            raise ConfigError(f"{where}: no \"path\", and the body has neither \"messages\" nor \"prompt\"")
    if not isinstance(path, str) or not is_measured("POST", path):
        raise ConfigError(f"{where}: path {path!r} is not one specproxy measures (e.g. {CHAT}, {COMPLETIONS})")
    return Request(path, body, encoding, where)


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
    """Captured bodies as Requests, byte for byte (``bench --from captured``)."""
    return [Request(c.path, c.body, c.content_encoding, f"captured turn {c.turn_id}")
            for c in captures if is_measured(c.method, c.path)]


def replay_line(c: Captured) -> bytes:
    """One line of ``export --format replay``: a wrapper whose body comes back as the same bytes."""
    out: dict[str, object] = {"path": c.path}
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
