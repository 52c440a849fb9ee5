"""The SSE decoder gives the same events for any split of the input, down to one byte a read."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specproxy.frames.sse import SSEDecoder
from readsplit import split


def decode(reads: list[bytes]) -> list[tuple[str, str, int]]:
    d = SSEDecoder()
    out = []
    for r in reads:
        out.extend((e.data, e.event, e.read_index) for e in d.feed(r))
    out.extend((e.data, e.event, e.read_index) for e in d.finish())
    return out


payloads = st.lists(
    st.tuples(st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20),
              st.sampled_from(["", "message", "delta"])),
    min_size=1, max_size=8)


def encode(events: list[tuple[str, str]], nl: bytes, pings: bool) -> bytes:
    out = b""
    for data, event in events:
        if pings:
            out += b": ping" + nl
        if event:
            out += b"event: " + event.encode() + nl
        out += b"data: " + data.encode() + nl + nl
    return out


@settings(max_examples=300, deadline=None)
@given(events=payloads, nl=st.sampled_from([b"\n", b"\r\n", b"\r"]), pings=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_gives_the_same_events(events, nl, pings, cuts):
    data = encode(events, nl, pings)
    whole = [(d, e) for d, e, _ in decode([data])]
    assert whole == list(events)
    pieces = split(data, cuts)
    assert [(d, e) for d, e, _ in decode(pieces)] == whole


@settings(max_examples=50, deadline=None)
@given(events=payloads, nl=st.sampled_from([b"\n", b"\r\n"]))
def test_one_byte_a_read_and_read_index_is_the_completing_read(events, nl):
    data = encode(events, nl, False)
    reads = [data[i : i + 1] for i in range(len(data))]
    got = decode(reads)
    assert [(d, e) for d, e, _ in got] == list(events)
    # each event completes at the read holding its blank line's terminator (the CR of a CRLF ends it)
    ends = []
    pos = 0
    for d, e in events:
        block = (b"event: " + e.encode() + nl if e else b"") + b"data: " + d.encode() + nl + nl
        pos += len(block)
        ends.append(pos - len(nl))
    assert [i for _, _, i in got] == ends


def test_utf8_split_inside_a_character():
    data = "data: café 🚀\n\n".encode()
    cut = data.index("🚀".encode()) + 2
    assert decode([data[:cut], data[cut:]]) == [("café 🚀", "", 1)]


def test_multiline_data_comments_and_unterminated_last_event():
    assert decode([b"data: a\ndata: b\n: comment\n\ndata: tail"]) == [("a\nb", "", 0), ("tail", "", 0)]


def test_cr_at_end_of_read_then_lf():
    assert decode([b"data: x\r", b"\n\r\n"]) == [("x", "", 1)]


def test_one_mebibyte_line():
    big = b"x" * (1 << 20)
    reads = [b"data: " + big[:1000], big[1000:], b"\n\n"]
    ((data, _, idx),) = decode(reads)
    assert len(data) == 1 << 20 and idx == 2


def test_a_long_line_read_one_byte_at_a_time_is_not_recopied():
    """256 KiB in 1-byte reads: the pending line is kept as parts and joined once when it ends, so
    the work is linear (re-joining on every read was quadratic: seconds in the measuring thread)."""
    body = b"x" * (256 * 1024)
    d = SSEDecoder()
    for i, byte in enumerate(b"data: " + body):
        assert d.feed(bytes([byte])) == []
    assert d._buf == b"" and len(d._parts) == len(body) + 6  # nothing joined while the line goes on
    (event,) = d.feed(b"\n\n")
    assert event.data == body.decode() and d._parts == []
