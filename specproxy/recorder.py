"""``Recorder``: what the forwarding path may do to a turn's measuring, and nothing more.

Why a Protocol here, below both ``wire`` and ``measure``: the wire relays a turn's bytes and must tell
whoever measures them of each read and of the end, but it never imports ``measure`` (the import
contracts in ``pyproject.toml`` say so). ``measure.turn_recorder.TurnRecorder`` implements it; the wire sees
only these few members, and a type checker holds both sides to them.

Threads: every member is called on the event loop, except that the relay thread's reads reach the
recorder as one object (``relayed_by_thread``), made into Python objects later, off the loop.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["KeptReads", "Recorder"]


class KeptReads(Protocol):
    """The reads the relay thread kept of one body (``_relayc.Turn``): taken by the recorder, off the loop."""

    @property
    def kept(self) -> int:
        """Bytes kept for measuring (charged to the memory budget)."""


class Recorder(Protocol):
    """One turn's measuring, as the wire drives it: the head, bytes in, room left, the end."""

    room: int  # bytes of the response still to keep; <= 0: relay, keep nothing more

    @property
    def ended(self) -> bool:
        """``finish`` (or the front's own failure) was called: the turn's outcome is decided."""

    def on_headers(self, t: float, status: int, content_type: str, content_encoding: str = "", *,
                   chunked: bool = False) -> None:
        """The response head arrived at ``t`` (``chunked``: the reads keep the chunked framing as relayed)."""

    def on_bytes(self, data: bytes, t_read: float, t_written: float) -> None:
        """One read relayed on the loop: read at ``t_read``, written to the client by ``t_written``."""

    def relayed_by_thread(self, turn: KeptReads) -> None:
        """The relay thread relayed the rest of the body; its kept reads are in ``turn``."""

    def finish(self, t_done: float, outcome: str = "ok", error: str | None = None) -> None:
        """The response ended at ``t_done`` (``outcome`` as the forwarding path saw it; once)."""
