"""Templates of stream chunks: the events that differ from one chunk only in their content string
(and a number the measuring never reads), so that a run of them can be read many at once.

Most chunks of a stream differ only in their content string (and often a timestamp). Once that is
proved on one chunk (``_content_template``, ``_varying_number``), a run of the chunks that follow is
read window by window (``_Template.run``): their bodies are sliced at fixed offsets, the template's
constant bytes joined between them and the result compared with the buffer at once, the bodies checked
and decoded joined (bodies with escapes: parsed by orjson as one JSON array, ``_escaped_bodies``). No
regular expression holds a template's bytes: compiling one costs more than the whole turn, and the
chunk id differs every turn. ``_scanc.template_run`` reads a run of the same template in C
(``fast_texts``).
"""

from __future__ import annotations

import re
from itertools import accumulate, repeat
from operator import itemgetter

import orjson

__all__ = ["MAX_VARYING_DIGITS"]

# a "content" key and its value's opening quote (a literal first, so the search is fast; a key whose
# opening quote is escaped is skipped by the caller), and the rest of a JSON string up to its closing quote
_CONTENT_KEY = re.compile(rb'"content"[ \t]*:[ \t]*"')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*+')


def _content_template(seg: bytes, obj: dict, content: str, texts: list[str]) -> _Template | None:
    """A template of the events that are ``seg`` but for their content string, if provably safe.

    ``seg`` is ``data: `` + JSON that parsed to ``obj``, a chunk whose only text is ``content`` in its
    one choice's delta (checked by the caller). Cut around that string's raw bytes, ``seg`` is ``prefix +
    raw + suffix``; any event ``prefix + body + suffix`` where ``"body"`` alone is a JSON string is the
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
    return _Template(prefix, head, dlen, closing, texts)


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


# the bytes a body written raw (the common case, decoded joined) never holds: a quote, a backslash, a
# control character (LF is left out: bodies are joined with it, and no event line holds one)
_UNSAFE_BYTES = b'"\\' + bytes(range(10)) + bytes(range(11, 32))
_MARK_UNSAFE = bytes.maketrans(_UNSAFE_BYTES, b"\\" * len(_UNSAFE_BYTES))
# varying numbers, each followed by LF: no leading zero (see _varying_number)
_NUMBERS = re.compile(rb"(?:(?:0|[1-9][0-9]*)\n)*")


class _Template:
    """The events ``prefix + body + head + digits + closing`` of one plain content chunk
    (``_content_template``): ``"body"`` a JSON string and, when the chunk has a varying number, ``dlen``
    digits of the allowed shape between ``head`` and ``closing`` (without one, ``head`` is all the rest).

    ``run`` reads a window of events with a fixed number of C calls, none per byte or event in Python:
    the bodies (and digits) are sliced at fixed offsets, the template's constant bytes are joined
    between them and the result compared with the buffer at once; the bodies are checked for anything
    but raw text at once and decoded joined."""

    __slots__ = ("body", "closing", "digits", "dlen", "end", "glue", "head", "plen", "prefix", "texts")

    def __init__(self, prefix: bytes, head: bytes, dlen: int, closing: bytes, texts: list[str]) -> None:
        self.prefix, self.head, self.dlen, self.closing = prefix, head, dlen, closing
        self.texts = texts  # the text list of the template's choice
        self.plen = len(prefix)
        clen = len(closing)
        self.body = itemgetter(slice(self.plen, -(len(head) + dlen + clen)))  # head starts with a quote
        self.digits = itemgetter(slice(-dlen - clen, -clen or None) if dlen else slice(0, 0))
        self.end = (closing if dlen else head) + b"\n\n"  # an event's bytes after its last variable part
        self.glue = self.end + prefix  # ... and the next event's before its body

    def fits(self, seg: bytes) -> bool:
        """``seg`` has this template's shape (its body and digits are not checked)."""
        return b"".join((self.prefix, self.body(seg), self.head, self.digits(seg), self.closing)) == seg

    def run(self, segs: list[bytes], i: int, j: int, buf: bytes, pos: int) -> tuple[int, int, str, int, int]:
        """How many of ``segs[i:j]`` in a row are this template's events (``segs[i]`` is at ``buf[pos]``):
        ``(count, their bytes with blank lines, their text, how many had text, the bytes up to the end of
        the last one that had)``."""
        window = segs[i:j]
        count = len(window)
        bodies = list(map(self.body, window))
        if self.dlen:
            digits = list(map(self.digits, window))
            pieces = [None, self.head, None, self.glue] * count
            pieces[0::4] = bodies
            pieces[2::4] = digits
            pieces[-1] = self.end
            rebuilt = b"".join(pieces)
            size = self.plen + len(rebuilt)
            same = buf.startswith(rebuilt, pos + self.plen)
        else:
            digits = repeat(b"")
            rebuilt = self.glue.join(bodies)
            size = self.plen + len(rebuilt) + len(self.end)
            same = buf.startswith(rebuilt, pos + self.plen) and buf.startswith(self.end, pos + size - len(self.end))
        # equal bytes prove every cut: the blank lines joined in can only fall on the events' own (no
        # body or digit run holds a LF), so each event is prefix + its body + head + its digits + closing
        if not (same and buf.startswith(self.prefix, pos)):
            # then not all are (or those bytes would be equal): which is the first that is not
            closing = self.closing if self.dlen else b""
            rebuilt_events = map(b"".join, zip(repeat(self.prefix), bodies, repeat(self.head), digits, repeat(closing)))
            alike = list(map(bytes.__eq__, window, rebuilt_events))
            alike.append(False)
            count = alike.index(False)
        if self.dlen and count:
            numbers = b"".join(digits[:count])  # dlen digits each
            if not numbers.isdigit() or (self.dlen > 1 and b"0" in numbers[:: self.dlen]):
                numbers = b"\n".join(digits[:count]) + b"\n"
                count = numbers.count(b"\n", 0, _NUMBERS.match(numbers).end())
        if count < len(window):
            bodies = bodies[:count]
            size = sum(map(len, window[:count])) + 2 * count
        joined = b"\n".join(bodies)
        if len(joined.translate(None, _UNSAFE_BYTES)) == len(joined):
            # LF is ASCII: each body decodes (with replacement) as it would alone
            text = joined.decode("utf-8", "replace").replace("\n", "")
        else:
            text, ok = _escaped_bodies(joined)
            if ok < count:
                count = ok
                bodies = bodies[:count]
                size = sum(map(len, window[:count])) + 2 * count
        nonempty = count - bodies.count(b"")
        if not nonempty or bodies[-1]:
            return count, size, text, nonempty, size if nonempty else 0
        with_text = count - list(map(bool, reversed(bodies))).index(True)  # trailing bodies were empty
        return count, size, text, nonempty, sum(map(len, window[:with_text])) + 2 * with_text


def _escaped_bodies(joined: bytes) -> tuple[str, int]:
    """The text of the bodies ``joined`` with LF, of which some hold an escape, a quote or a control
    character, and how many in a row from the first are JSON strings (their decoded text, as the
    reference parses the decoded event)."""
    # all at once, as the strings of one JSON array, when every quote comes after a backslash: then
    # each string of the array is one body, as one that ends a string early (after an escaped
    # backslash) or a backslash at a body's end would leave the rest outside any string: not JSON
    if b'"' not in joined.replace(b'\\"', b""):
        try:
            values = orjson.loads(b'["' + joined.replace(b"\n", b'","') + b'"]')
            return "".join(values), len(values)
        except ValueError:  # not UTF-8, a control character, a bad escape: see which, one by one
            pass
    values = joined.decode("utf-8", "replace").split("\n")  # each body decoded as alone
    # those with such bytes: split at each one (all made backslashes) and count the LFs before it
    pieces = joined.translate(_MARK_UNSAFE).split(b"\\")
    pieces.pop()
    for k in dict.fromkeys(accumulate(map(bytes.count, pieces, repeat(b"\n")))):
        try:
            values[k] = orjson.loads('"' + values[k] + '"')
        except ValueError:
            return "".join(values[:k]), k
    return "".join(values), len(values)
