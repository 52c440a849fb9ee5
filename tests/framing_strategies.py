"""Hypothesis strategies for chunked bodies, shared by the framing tests of the C relay and its thread."""

from hypothesis import strategies as st

# chunk extensions, well formed (RFC 9112 7.1.1) and not: a control byte, no name, no value after "=",
# an unclosed or broken quoted-string, a space inside a name
extension = st.sampled_from([b"", b";a=b", b" ; x", b"\t", b';q="x;y"', b'; n = "a\\"b\t" ;m', b";x=1;y=2 "] * 3
                            + [b";\x01x", b";a=b\x00", b";", b";a=", b";a b", b';q="x', b';q="\x7f"', b";a=\x1f",
                               b'; a="\\\x02"', b";=b"])

# trailer lines (CRLF added), well formed and not: a NUL or another control byte in the value, no colon,
# no name, a space before the colon, an obs-fold line, a line over the limit
trailer = st.sampled_from([b"T: 1", b"X-Checksum: abc", b"Foo:", b"Server-Timing: total;dur=12", b"V: a\tb \xff"] * 3
                          + [b"X-A: a\x00b", b"nocolon", b": v", b"X : 1", b" folded", b"X: \x7f", b"X\x01: 1",
                             b"Long: " + b"v" * 5000])

# a chunk-size line: hex size (sometimes malformed), optional extension, CRLF or a lone LF
size_line = st.one_of(
    st.builds(lambda n, upper, ext, lf: (b"%X" if upper else b"%x") % n + ext + (b"\n" if lf else b"\r\n"),
              st.integers(0, 400), st.booleans(), extension, st.booleans()),
    st.sampled_from([b"zz\r\n", b"\r\n", b"0x10\r\n", b" \r\n", b"1_0\r\n", b"  a  \r\n", b"-1\r\n",
                     b"1234567890abcdef0\r\n", b"000000000000000a\r\n"]),  # 17 and 16 digits: both refused
)


@st.composite
def chunked_bodies(draw) -> bytes:
    """Mostly well-formed chunked bodies, with now and then a malformed size or extension, a bad CRLF, a
    malformed trailer or a long line."""
    out = []
    for _ in range(draw(st.integers(0, 8))):
        line = draw(size_line)
        out.append(line)
        try:
            n = max(0, min(int(line.split(b";")[0].strip(b" \t\r\n"), 16), 400))
        except ValueError:
            n = 3
        out.append(draw(st.binary(min_size=n, max_size=n)))
        out.append(draw(st.sampled_from([b"\r\n"] * 6 + [b"\n\r", b"xx"])))
    out.append(b"0" + draw(extension) + b"\r\n" + b"".join(t + b"\r\n" for t in draw(st.lists(trailer, max_size=3)))
               + b"\r\n")
    if draw(st.booleans()):
        out.insert(0, b"f" * draw(st.integers(1, 5000)))  # an overlong or garbled first line
    return b"".join(out) + draw(st.binary(max_size=10))
