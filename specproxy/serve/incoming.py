"""What the forwarding path needs of one exchange's two sides, whichever front read the request.

Why apart from ``proxy.py``: the header rules (``headers.py``) read a request as ``proxy.py`` does, and
``proxy.py`` applies them; with these types in either of the two, each would import the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = ["Client", "Incoming"]


class Incoming(NamedTuple):
    """What the forwarding path needs of a client's request, whichever front read it (aiohttp's server or
    the lane): the request line, the header bytes as they came, and the few header values it acts on."""

    method: str
    path: str  # the decoded path, without the query: which endpoint (``is_measured``)
    target: bytes  # the path and query as sent, forwarded as they are
    http11: bool
    keep_alive: bool  # the client allows another request on the connection after this one
    raw_headers: Sequence[tuple[bytes, bytes]]
    connection: Sequence[str | bytes]  # the Connection header's values: more hop-by-hop names
    label: str | None  # X-Specproxy-Label
    content_encoding: str  # of the request body


class Client(Protocol):
    """The front's side of one exchange: where the response goes."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    async def start(self, status: int, head: bytes, keep_alive: bool) -> None:
        """Write the response head (the body follows on ``transport``)."""

    async def drain(self) -> None:
        """Until the client has taken what waits in the transport's buffer."""

    def abort(self) -> None:
        """Cut the connection (a bug of ours mid-response)."""
