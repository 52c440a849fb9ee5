"""Templates of stream chunks: the events that differ from one chunk only in their content string
(and a number the measuring never reads), so that a run of them can be read many at once.

Most chunks of a stream differ only in their content string (and often a timestamp). Once that is
proved on one chunk (``content_template``, ``_varying_number``), a run of the chunks that follow is
read by one C call (``_scanc.template_run``, from ``fast_texts``), which checks each event's bytes
against the template and decodes its string. No regular expression holds a template's bytes:
compiling one costs more than the whole turn, and the chunk id differs every turn.
"""

from __future__ import annotations

import re

import orjson

__all__ = ["MAX_VARYING_DIGITS", "ChunkTemplate", "content_template"]

# a "content" key and its value's opening quote (a literal first, so the search is fast; a key whose
# opening quote is escaped is skipped by the caller), and the rest of a JSON string up to its closing quote
_CONTENT_KEY = re.compile(rb'"content"[ \t]*:[ \t]*"')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*+')


def content_template(seg: bytes, obj: dict, content: str, texts: list[str]) -> ChunkTemplate | None:
    """A template of the events that are ``seg`` but for their content string, if provably safe.

    ``seg`` is ``data: `` + JSON that parsed to ``obj``, a chunk that ``openai.read_chunk`` reads as the
    text ``content`` of its first choice's delta and nothing else (checked by the caller). Cut around
    that string's raw bytes, ``seg`` is ``prefix + raw + suffix``; any event ``prefix + body + suffix`` where ``"body"`` alone is a JSON string is the
    same JSON token stream with another string token in that one place: valid, and equal to ``obj`` but
    for that string's value, which is ``body`` read as a JSON string (decoded with replacement characters
    first, as the SSE decoder decodes). Which value that string is, is proved by parsing once with a
    different body: the delta's content must change to it and nothing else may (a duplicate key, or a
    ``"content"`` key elsewhere in the chunk, fails this and gives no template). ``texts``: the list the
    template's text goes to.
    """
    for m in _CONTENT_KEY.finditer(seg):
        start = m.end()
        if seg[m.start() - 1] == 92:  # the key's opening quote is escaped: it is inside another string
            continue
        end = _STRING_REST.match(seg, start).end()
        try:
            if orjson.loads(seg[start - 1 : end + 1]) == content:
                break
        except ValueError:
            continue
    else:
        return None
    prefix, raw, suffix = seg[:start], seg[start:end], seg[end:]
    probe = "p" if content != "p" else "q"
    try:
        other = orjson.loads(prefix[6:] + probe.encode() + suffix)
        delta = other["choices"][0]["delta"]
        if delta.get("content") != probe:
            return None
        delta["content"] = content
    except (ValueError, LookupError, TypeError, AttributeError):
        return None
    if other != obj:
        return None
    head, dlen, closing = _varying_number(prefix[6:] + raw, suffix, obj)
    return ChunkTemplate(prefix, head, dlen, closing, texts)


# the chunk fields the measuring reads (openai.read_chunk): a digit run anywhere else cannot change a Record
_READ_KEYS = frozenset(("choices", "usage", "timings"))
_DIGIT_RUN = re.compile(rb"[0-9]+")
MAX_VARYING_DIGITS = 19  # an int64, e.g. a nanosecond timestamp


def _varying_number(json_head: bytes, suffix: bytes, obj: dict) -> tuple[bytes, int, bytes]:
    """Split ``suffix`` into ``(head, len(digits), tail)`` around its last run of digits that only a field
    the measuring never reads holds (a timestamp like ``created`` or a benchmark's send time, which
    change from chunk to chunk), or return ``(suffix, 0, b"")``.

    Proved like the content: the event parsed with other digits there must equal ``obj`` but for one
    top-level key outside ``_READ_KEYS`` (or not differ at all). Any digit string of the allowed shape
    (at most ``MAX_VARYING_DIGITS``, no leading zero) sits in the same JSON token, so the same proof
    holds for every such event; a shape that might not parse (a leading zero) is left to orjson. The
    template's events have as many digits as this one (a nanosecond or second timestamp keeps its
    length for centuries): the body then ends at a fixed offset from the event's end."""
    for m in reversed(list(_DIGIT_RUN.finditer(suffix))):
        start, end = m.span()
        if end - start > MAX_VARYING_DIGITS or (suffix[start] == 48 and end - start > 1):
            continue  # too long, or not of the shape every event of the template must have
        probe = suffix[:start] + b"7" * (end - start) + suffix[end:]
        try:
            other = orjson.loads(json_head + probe)
        except ValueError:
            continue
        if type(other) is not dict or other.keys() != obj.keys():
            continue
        differ = [k for k in obj if other[k] != obj[k]]
        if len(differ) <= 1 and not (set(differ) & _READ_KEYS):
            return suffix[:start], end - start, suffix[end:]
    return suffix, 0, b""


class ChunkTemplate:
    """The events ``prefix + body + head + digits + closing`` of one plain content chunk
    (``content_template``): ``"body"`` a JSON string and, when the chunk has a varying number, ``dlen``
    digits of the allowed shape between ``head`` and ``closing`` (without one, ``head`` is all the rest).
    A run of them is read by ``_scanc.template_run``; ``texts``: the list their text goes to."""

    __slots__ = ("closing", "dlen", "head", "prefix", "texts")

    def __init__(self, prefix: bytes, head: bytes, dlen: int, closing: bytes, texts: list[str]) -> None:
        self.prefix, self.head, self.dlen, self.closing = prefix, head, dlen, closing
        self.texts = texts
