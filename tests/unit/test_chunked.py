"""dechunk_reads against an independent oracle: random framings, extensions, trailers, read splits,
truncation and malformed framing. The oracle knows, byte by byte, which framed bytes are payload.
Reads of one whole frame each (the shape read all at once) are also checked against the state
machine alone, unchanged and with every kind of change that takes them out of that shape."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.frames import chunked as chunked_mod
from specproxy.frames.chunked import Dechunked, _stepwise, dechunk_reads, join_reads
from framing_strategies import chunked_bodies
from readsplit import split


def frame(payload: bytes, sizes: list[int], exts: list[bytes], trailers: list[bytes], upper: bool):
    """Framed bytes and a per-byte mask (True = payload byte)."""
    out, mask = bytearray(), []
    pos, i = 0, 0
    while pos < len(payload):
        n = max(1, sizes[i % len(sizes)]) if sizes else len(payload)
        data = payload[pos : pos + n]
        head = (f"{len(data):X}" if upper else f"{len(data):x}").encode() + exts[i % len(exts)] + b"\r\n"
        out += head
        mask += [False] * len(head)
        out += data
        mask += [True] * len(data)
        out += b"\r\n"
        mask += [False, False]
        pos += len(data)
        i += 1
    last = b"0" + (exts[0] if exts else b"") + b"\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"
    out += last
    mask += [False] * len(last)
    return bytes(out), mask


def oracle(reads: list[bytes], mask: list[bool]) -> list[bytes]:
    out, pos = [], 0
    for r in reads:
        out.append(bytes(b for b, m in zip(r, mask[pos : pos + len(r)]) if m))
        pos += len(r)
    return out


exts = st.lists(st.sampled_from([b"", b";a=b", b" ; name", b';q="x;y"', b";x=1;y=2"]), min_size=1, max_size=3)
trailers = st.lists(st.sampled_from([b"X-Checksum: abc", b"Server-Timing: total;dur=12", b"Foo:"]), max_size=2)


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=300), sizes=st.lists(st.integers(1, 40), max_size=5), exts=exts,
       trailers=trailers, upper=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=15))
def test_random_framings_and_splits(payload, sizes, exts, trailers, upper, cuts):
    framed, mask = frame(payload, sizes, exts, trailers, upper)
    reads = split(framed, cuts)
    got = dechunk_reads(reads)
    assert list(got) == oracle(reads, mask)
    assert got.error is None and got.complete
    assert b"".join(got) == payload


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=1, max_size=200), sizes=st.lists(st.integers(1, 30), max_size=4), exts=exts,
       cut=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_truncated_stream_returns_what_arrived(payload, sizes, exts, cut, cuts):
    framed, mask = frame(payload, sizes, exts, [], False)
    cut %= len(framed)  # strictly shorter than the whole body
    reads = split(framed[:cut], cuts)
    got = dechunk_reads(reads)
    assert list(got) == oracle(reads, mask[:cut])
    assert got.error is None and not got.complete


def test_one_byte_reads():
    framed, mask = frame(b"data: hello\n\n" * 3, [5, 7], [b";e=1"], [b"T: v"], False)
    reads = [framed[i : i + 1] for i in range(len(framed))]
    got = dechunk_reads(reads)
    assert len(got) == len(reads) and list(got) == oracle(reads, mask) and got.complete


def test_framing_only_reads_give_empty_payload():
    got = dechunk_reads([b"5\r\n", b"hello", b"\r\n", b"0\r\n\r\n"])
    assert list(got) == [b"", b"hello", b"", b""] and got.complete and got.error is None


def test_a_lone_lf_is_malformed_as_the_relay_says():
    got = dechunk_reads([b"3\nabc\r\n0\r\n\r\n"])
    assert list(got) == [b""] and not got.complete and "not ended by CRLF" in got.error
    got = dechunk_reads([b"3\r\nabc\n0\r\n\r\n"])
    assert list(got) == [b"abc"] and not got.complete and "CRLF" in got.error


def test_malformed_size_stops_decoding():
    got = dechunk_reads([b"3\r\nabc\r\n", b"zz\r\nmore\r\n", b"4\r\nlate\r\n"])
    assert list(got) == [b"abc", b"", b""]
    assert got.error and "chunk size" in got.error and not got.complete


def test_hex_prefix_and_signs_are_malformed():
    for bad in (b"0x3\r\nabc\r\n0\r\n\r\n", b"+3\r\nabc\r\n0\r\n\r\n", b"\r\nabc\r\n", b"1_0\r\n"):
        got = dechunk_reads([bad])
        assert got.error is not None and list(got) == [b""]


def test_missing_crlf_after_data():
    got = dechunk_reads([b"3\r\nabcX\r\n0\r\n\r\n"])
    assert list(got) == [b"abc"] and got.error and "CRLF" in got.error


def test_bytes_after_the_last_chunk():
    got = dechunk_reads([b"1\r\na\r\n0\r\n\r\n", b"junk"])
    assert list(got) == [b"a", b""] and got.error and "after the last chunk" in got.error
    got = dechunk_reads([b"1\r\na\r\n0\r\n\r\njunk"])
    assert list(got) == [b"a"] and got.error


def test_endless_size_line_is_malformed():
    got = dechunk_reads([b"1" * 40_000, b"2" * 40_000, b"\r\n"])
    assert got.error and list(got) == [b"", b"", b""]
    got = dechunk_reads([b"1" * 3000, b"2" * 3000, b"\r\n"])  # over the limit only together
    assert "over 4096 bytes" in got.error and list(got) == [b"", b"", b""]


def test_empty_input():
    got = dechunk_reads([])
    assert list(got) == [] and got.error is None and not got.complete


# one whole frame per read is the shape engines write; each change below leaves it, some into framing
# that is still fine, some into malformed framing: the C join's result must be the state machine's
def _frames(payloads: list[bytes], upper: bool) -> list[bytes]:
    return [(b"%X" if upper else b"%x") % len(p) + b"\r\n" + p + b"\r\n" for p in payloads] + [b"0\r\n\r\n"]


CHANGES = [
    lambda r: r[:-2] + b"\n",  # a lone LF after the data (malformed)
    lambda r: r.replace(b"\r\n", b"\n", 1),  # a lone LF after the size (malformed)
    lambda r: r.replace(b"\r\n", b";x=1\r\n", 1),  # an extension
    lambda r: b"00" + r,  # leading zeros
    lambda r: b"+" + r, lambda r: b" " + r, lambda r: b"0x" + r,  # not hex
    lambda r: r[:-2] + b"X\r\n",  # more data than the size says
    lambda r: r[:-3] + b"\r\n",  # less
    lambda r: r[:-2],  # no CRLF after the data
    lambda r: r[:-2] + b"ab", lambda r: r[:-2] + b"\n\n",  # other bytes in its place
    lambda r: r[r.index(b"\r\n") :],  # no size
    lambda r: b"0\r\n\r\n",  # the last chunk in the middle
    lambda r: b"",  # an empty read
]


@settings(max_examples=100, deadline=None)
@given(payloads=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=12), upper=st.booleans())
def test_whole_frame_reads_give_their_payloads(payloads, upper):
    got = dechunk_reads(_frames(payloads, upper))
    assert list(got) == payloads + [b""] and got.complete and got.error is None


def test_an_endless_size_line_in_whole_frames_is_malformed():
    reads = [b"0" * 70_000 + b"5\r\nhello\r\n", b"0\r\n\r\n"]
    got = dechunk_reads(reads)
    assert got.error and "4096" in got.error and list(got) == [b"", b""]


def _joined(reads: list[bytes]):
    """What join_reads must give when it reads ``reads``: the state machine's payloads joined."""
    expected = _stepwise(reads, Dechunked())
    ends, total = [], 0
    for p in expected:
        total += len(p)
        ends.append(total)
    return expected, (b"".join(expected), ends, expected.complete)


needs_scanc = pytest.mark.skipif(chunked_mod.scans is None, reason="specproxy.frames._scanc is not built")


def join_whole_frames(reads):
    """``join_reads`` of chunked reads, checked to consume a copy of the list only when it joins it."""
    mine = list(reads)
    got = join_reads(mine, True)
    assert mine == ([] if got is not None else list(reads)), "joined reads are consumed; refused ones are not"
    return got


@needs_scanc
@settings(max_examples=examples(200), deadline=None)
@given(payloads=st.lists(st.binary(min_size=1, max_size=40), max_size=12), upper=st.booleans(),
       where=st.integers(0, 100), change=st.integers(0, len(CHANGES) + 3), truncated=st.booleans())
def test_joined_whole_frames_equal_the_state_machine(payloads, upper, where, change, truncated):
    """The C join (the native parser) reads what the reference reads, and leaves malformed framing to it."""
    reads = _frames(payloads, upper)
    if truncated:
        reads.pop()  # the stream was cut after a whole frame: not complete, nothing wrong
    k = where % max(1, len(reads))
    if reads and change < len(CHANGES):
        reads[k] = CHANGES[change](reads[k])
    elif change == len(CHANGES) and k + 1 < len(reads):
        reads[k : k + 2] = [reads[k] + reads[k + 1]]  # two frames in one read: still joined in C
    elif reads and change == len(CHANGES) + 1:
        cut = where % (len(reads[k]) + 1)
        reads[k : k + 1] = [reads[k][:cut], reads[k][cut:]]  # a frame across two reads (or an empty read)
    expected, as_joined = _joined(reads)
    got = join_whole_frames(reads)
    if got is not None:
        assert got == as_joined and expected.error is None
    if change >= len(CHANGES) + 2 or (change == len(CHANGES)):
        assert got == as_joined  # the shapes it exists for are never left to the state machine
        assert got[0] == b"".join(payloads) and got[2] == (not truncated)


@needs_scanc
def test_join_reads_any_well_formed_framing_and_leaves_the_rest_to_the_reference():
    ok = [b"5\r\nhello\r\n", b"3\r\nabc\r\n2\r\nde\r\n", b"0\r\n\r\n"]
    assert join_whole_frames(ok) == (b"helloabcde", [5, 10, 10], True)
    assert join_whole_frames([]) == (b"", [], False)
    for reads, joined in (([b"5;x=1\r\nhello\r\n"], (b"hello", [5], False)),
                          ([b"5\r\nhel", b"lo\r\n"], (b"hello", [3, 5], False)),
                          ([b"0\r\nX-T: 1\r\n\r\n"], (b"", [0], True)), ([b"0\r\n", b"\r\n"], (b"", [0, 0], True)),
                          ([b"0" * 14 + b"1\r\nx\r\n"], (b"x", [1], False))):
        assert join_whole_frames(reads) == joined, reads
        expected = dechunk_reads(reads)
        assert b"".join(expected) == joined[0] and expected.complete == joined[2] and expected.error is None
    for reads in ([b"5\nhello\r\n"], [b"0\r\n\r\n", b"1\r\nx\r\n"], [b"1\r\nx\r\n0\r\n\r\nz"],
                  [b"0" * 16 + b"1\r\nx\r\n"], [b"5\r\nhello", b"\n"], [bytearray(b"1\r\nx\r\n")]):
        assert join_whole_frames(reads) is None, reads
        assert isinstance(reads[0], bytearray) or dechunk_reads(reads).error is not None
    with pytest.raises(TypeError):
        join_reads((b"1\r\nx\r\n",), True)


@needs_scanc
@settings(max_examples=examples(200), deadline=None)
@given(body=chunked_bodies(), cuts=st.lists(st.integers(0, 12_000), max_size=20))
def test_the_native_join_equals_the_reference_on_any_framing(body, cuts):
    """The measuring's native pass and the reference agree on every body the relay's strategies make,
    well formed or not, however it is split into reads."""
    reads = split(body, cuts)
    expected, as_joined = _joined(reads)
    got = join_whole_frames(reads)
    assert got == (as_joined if expected.error is None else None)


@needs_scanc
def test_unframed_reads_are_joined_as_they_are_and_consumed():
    reads = [b"data: a\n", b"", b"\ndata: b\n\n"]
    assert join_reads(reads, False) == (b"data: a\n\ndata: b\n\n", [8, 8, 18], True) and reads == []
    assert join_reads([], False) == (b"", [], True)


@needs_scanc
def test_a_joined_read_is_let_go_of_by_the_join():
    """The join holds the body once: each read it copied is no longer referenced by the list."""
    import sys
    big = [b"%x\r\n" % 100_000 + bytes(100_000) + b"\r\n" for _ in range(3)] + [b"0\r\n\r\n"]
    first = big[0]
    before = sys.getrefcount(first)
    payload, ends, complete = join_reads(big, True)
    assert sys.getrefcount(first) == before - 1 and big == []
    assert len(payload) == 300_000 and ends == [100_000, 200_000, 300_000, 300_000] and complete


@needs_scanc
def test_a_large_body_is_joined_as_the_reference_reads_it():
    """Over a megabyte in frames of 300 kB, split in several ways: the same payload as the reference, and
    malformed framing or bytes after the end left, untouched, to the reference (the property tests above
    use small bodies)."""
    parts = [bytes([i]) * 300_000 for i in range(4)]  # 1.2 MB of payload
    frames = [b"%x\r\n%b\r\n" % (len(p), p) for p in parts]
    for reads in (frames + [b"0\r\n\r\n"], frames[:2] + [frames[2][:7], frames[2][7:]] + frames[3:],
                  [b"".join(frames)]):
        expected, as_joined = _joined(reads)
        assert join_whole_frames(reads) == as_joined and expected.error is None
        assert as_joined[0] == b"".join(parts)
    for reads in (frames[:3] + [frames[3][:-2] + b"XX"], frames + [b"0\r\n\r\n", b"1\r\nx\r\n"],
                  frames + [b"0\r\n\r\nz"]):
        assert join_whole_frames(reads) is None  # (join_whole_frames checks the list is untouched)
        assert dechunk_reads(reads).error is not None
