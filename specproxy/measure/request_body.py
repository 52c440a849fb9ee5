"""What measuring reads of a request body: its model and its prompt's parts (``build_record``).

Why apart: a request body can be as large as ``max_body_bytes``; one over ``max_counted_bytes`` is not
parsed at all (orjson takes twice a body's size to parse it) and only its model is read, by a byte search
(``model_only``); the rest is parsed once, strictly (``openai.parse_json``).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import orjson

from specproxy.measure.apis import Api
from specproxy.measure.json_keys import sole_key
from specproxy.measure.openai import PromptParts, parse_json

__all__ = ["RequestRead", "inflate", "model_only", "read_request"]


@dataclass(frozen=True, slots=True)
class RequestRead:
    parsed: bool
    model: str | None = None
    parts: PromptParts | None = None


def inflate(body: bytes, encoding: str) -> bytes:
    """A gzip/deflate request body, decoded for reading (it was forwarded as sent)."""
    if encoding.strip().lower() not in ("gzip", "x-gzip", "deflate") or not body:
        return body
    try:
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)
        out = inflater.decompress(body, 64 * 1024 * 1024)  # bounded: a zip bomb is not our business
        return out if not inflater.unconsumed_tail else b""
    except zlib.error:
        return b""


_MODEL_KEY = re.compile(rb'"model"[ \t\r\n]*:[ \t\r\n]*("(?:[^"\\]|\\.){0,256}")')


def model_only(body: bytes) -> str | None:
    """The value of the one ``"model"`` key of a JSON body, found without parsing it: None when there is
    none, more than one, or it is not a short string. (In valid JSON, a quote not escaped by a backslash
    delimits a string, so ``"model":"..."`` outside an escape is a key and its value.)"""
    m = sole_key(body, _MODEL_KEY.finditer(body))
    try:
        value = orjson.loads(m.group(1)) if m is not None else None
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def read_request(body: bytes, api: Api) -> RequestRead:
    try:
        obj = parse_json(body)
        parts = api.split(obj)
    except (ValueError, TypeError, RecursionError):
        return RequestRead(parsed=False)
    model = obj.get("model")
    return RequestRead(parsed=True, model=model if isinstance(model, str) else None, parts=parts)
