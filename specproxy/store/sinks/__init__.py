"""Where a fleet's turns go besides the local database: the interface every sink implements.

Why an interface: the shipper (``store/shipper.py``) reads the local database forward and hands each
sink batches of rows; it knows nothing of the remote engine. A sink only has to take a batch of rows of
one table idempotently (a row it already holds is ignored, so that a batch sent again after a crash or
a timeout costs nothing) and say which rows it refused and why. PostgreSQL is the one built
(``postgres.py``); a ClickHouse sink would implement the same three methods (docs/operations.md, "Fleet").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specproxy.errors import SpecproxyError

__all__ = ["Identity", "Refused", "Sink", "SinkError", "make_sink"]


class SinkError(SpecproxyError):
    """The sink took nothing of this call (unreachable, credentials, permissions, a name clash): the
    shipper keeps the rows in the local database and tries again later. The message is one line."""


@dataclass(frozen=True)
class Identity:
    """Who ships: the proxy's name and its local database's own random id (``store_meta``), so that two
    proxies under one name are told apart, never merged."""

    proxy_name: str
    store_id: str


@dataclass(frozen=True)
class Refused:
    """A row the sink would not hold (a constraint, a value out of its column's range): set aside with the
    reason, while the rest of its batch goes in."""

    index: int  # in the batch sent
    reason: str  # the engine's one-line reason, never the row's values


class Sink(Protocol):
    name: str
    """The sink's URL without a password: its key in the local database's ``sink_progress``."""

    def open(self, identity: Identity) -> None:
        """Connect, bring the remote schema up to date, claim ``identity.proxy_name``; SinkError if not."""

    def send(self, table: str, columns: tuple[str, ...], rows: list[tuple]) -> list[Refused]:
        """Hold ``rows`` (of the local ``table``, values in ``columns`` order), ignoring those already
        held; return those refused. SinkError when none could be held (the whole call is retried)."""

    def close(self) -> None:
        """Let go of the connection (after a SinkError too)."""


def make_sink(url: str) -> Sink:
    """The sink a Config ``sink`` URL names (checked by ``config.check_sink_url``)."""
    from specproxy.store.sinks.postgres import PostgresSink

    return PostgresSink(url)
