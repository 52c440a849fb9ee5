"""The header rules of both directions: what is forwarded, what is added, what the client is told.

Why apart: each rule is one function both fronts reach through ``Proxy.forward``. Transparency: the
upstream is the configured one, never one taken from the request (absolute-form URIs, Host,
X-Forwarded-Host, a body's ``base_url`` are ignored); header bytes pass as they came (even obs-text);
hop-by-hop headers (RFC 9110 section 7.6.1) and those a Connection header names are dropped,
end-to-end ones kept; nothing is decompressed or compressed. Header names with an underscore are not
forwarded either way, as nginx drops them from requests by default: a server that reads ``_`` as
``-`` (CGI-style environments do) would take ``Transfer_Encoding`` for framing nobody vetted.
"""

from __future__ import annotations

from yarl import URL

from specproxy.serve.incoming import Incoming
from specproxy.wire.upstream import CHUNKED, CLOSE, DECHUNK, ENCODE, PASS, ResponseHead

__all__ = ["LABEL_HEADER", "connection_tokens", "host_header", "request_head", "response_head"]

LABEL_HEADER = "X-Specproxy-Label"

# RFC 9110 7.6.1: meaningful only for one connection, never forwarded. Plus Host (set for the
# upstream) and Content-Length (recomputed from the exact body we send).
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
    )
)
# Expect: the proxy has read the whole body before it forwards; passing "100-continue" on would make the
# upstream client wait for an interim response some servers never send.
_NOT_FORWARDED_UP = _HOP_BY_HOP | {"host", "content-length", "expect", LABEL_HEADER.lower()}
_NOT_FORWARDED_DOWN = _HOP_BY_HOP
_NOT_FORWARDED_UP_B = frozenset(h.encode() for h in _NOT_FORWARDED_UP)
_NOT_FORWARDED_DOWN_B = frozenset(h.encode() for h in _NOT_FORWARDED_DOWN)


def request_head(base_path: bytes, host: bytes, req: Incoming, body: bytes) -> bytes:
    """The request line and headers for the upstream: the client's header bytes as they came, minus
    hop-by-hop ones, our own and underscore names; Host is the upstream's; Content-Length is that of the
    exact body sent."""
    named = connection_tokens(req.connection)
    out = [b"%s %s%s HTTP/1.1\r\nHost: %s\r\n" % (req.method.encode(), base_path, req.target, host)]
    for name, value in req.raw_headers:
        low = name.lower()
        if low not in _NOT_FORWARDED_UP_B and low not in named and b"_" not in low:
            out.append(b"%s: %s\r\n" % (name, value))
    if body or req.method not in ("GET", "HEAD"):
        out.append(b"Content-Length: %d\r\n" % len(body))
    out.append(b"\r\n")
    return b"".join(out)


def host_header(url: URL) -> bytes:
    host = url.raw_host or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if url.explicit_port and url.port != {"http": 80, "https": 443}.get(url.scheme):
        host = f"{host}:{url.port}"
    return host.encode("ascii")


def connection_tokens(values) -> set[bytes]:
    """The tokens of Connection header values, lower case: header names hop-by-hop for this one connection
    (RFC 9110 7.6.1), and ``close``."""
    named: set[bytes] = set()
    for value in values:
        if isinstance(value, str):
            value = value.encode("latin-1", "replace")
        named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return named


def response_head(head: ResponseHead, req: Incoming) -> tuple[bytes, int, bool]:
    """The client's response head, how its body is framed for the client, and whether the connection is kept.

    The upstream's header bytes pass unchanged, minus hop-by-hop ones. A chunked body passes with its
    framing to an HTTP/1.1 client, and is unframed for an HTTP/1.0 one (which then sees the end by the
    close); a body that ends by the upstream's close is chunked for an HTTP/1.1 client. A 1xx or 204 loses
    any Content-Length (and, hop-by-hop, any Transfer-Encoding): it has no body, and a client must not be
    told a length it would wait for."""
    http11 = req.http11
    keep = http11 and req.keep_alive
    named = connection_tokens([v for k, v in head.headers if k.lower() == b"connection"])
    framing = head.framing
    no_length = head.status < 200 or head.status == 204  # RFC 9110 8.6: never a Content-Length on these
    lines = [b"HTTP/1.%d %d %s\r\n" % (1 if http11 else 0, head.status, head.reason)]
    for name, value in head.headers:
        low = name.lower()
        if low in _NOT_FORWARDED_DOWN_B or low in named or b"_" in low:
            continue
        if low == b"content-length" and (head.transfer_encoding or no_length):
            continue  # RFC 9112 6.3: Transfer-Encoding overrides it, whatever framing follows; both invite smuggling
        lines.append(b"%s: %s\r\n" % (name, value))
    mode = PASS
    if framing == CHUNKED:
        if http11:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        else:
            mode, keep = DECHUNK, False
    elif framing == CLOSE:
        if http11:
            mode = ENCODE
            lines.append(b"Transfer-Encoding: chunked\r\n")
        else:
            keep = False
    if not keep and http11:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), mode, keep
