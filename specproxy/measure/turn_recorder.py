"""``TurnRecorder``: what the forwarding path records of one turn, stamped as its bytes crossed the sockets.

Why it is shaped this way: the forwarding path may only append (``on_bytes`` is three list appends); it
implements ``specproxy.recorder.Recorder``, the few members the wire may call, and keeps what the proxy
knew of the request (its body, headers, when it came). Everything that costs CPU is done later, off the
forwarding path, by ``build.build_record``, which turns the finished recorder into a Record.

Lifecycle (an invariant, asserted): ``TurnRecorder(...)`` -> ``on_headers`` (at most once) ->
``on_bytes`` (any number) -> exactly one of ``finish`` or ``fail`` -> ``build_record`` (once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specproxy.measure.chunk_gaps import StreamTiming
from specproxy.measure.tenant import TenantRule
from specproxy.record import new_turn_id

__all__ = ["SMALL_KEEP", "TurnRecorder"]


class TurnRecorder:
    """Collects one turn on the forwarding path; ``build.build_record`` makes its Record off it."""

    __slots__ = (
        "_ended",
        "_small_after",
        "_take",
        "backlog_charge",
        "body",
        "body_charge",
        "budget_capped",
        "max_counted",
        "chunked",
        "concurrency",
        "conn_id",
        "content_encoding",
        "content_type",
        "error",
        "client_header",
        "headers",
        "id",
        "kept_bytes",
        "instance_id",
        "capped",
        "label",
        "measured",
        "method",
        "outcome",
        "path",
        "proxy_name",
        "relayed",
        "read_times",
        "request_bytes",
        "request_encoding",
        "reads",
        "shed",
        "room",
        "status",
        "store_text",
        "t_done",
        "t_request",
        "t_upstream_headers",
        "t_wall",
        "tenant_rule",
        "timing",
        "trim_heap",
        "write_times",
    )

    def __init__(
        self,
        *,
        method: str,
        path: str,
        body: bytes,
        t_wall: float,
        t_request: float,
        concurrency: int = 1,
        label: str | None = None,
        instance_id: str | None = None,
        conn_id: int | None = None,
        store_text: bool = False,
        request_encoding: str = "",
        headers: Sequence[tuple[bytes, bytes]] = (),
        max_bytes: int | None = None,
        measured: bool = True,
        client_header: bytes = b"user-agent",
        take: Callable[[int, bool], bool] | None = None,
        body_charge: int = 0,
        max_counted: int | None = None,
        proxy_name: str | None = None,
        let_go: Callable[[], None] | None = None,
        tenant_rule: TenantRule | None = None,
    ) -> None:
        """``headers``: the request's raw headers (kept as a reference; the client, ``client_header``'s
        value, is read off the loop).
        ``measured=False``: a path specproxy does not measure; its row says what the forwarding path
        saw (method, path, status, timings, outcome), and none of its body is kept.
        ``take``: charges a kept response read to the process's memory budget (``wire.memory.take``; the
        first ``SMALL_KEEP`` bytes as a small turn's), False when it has no room: that read and every
        later one is relayed, not kept. ``body_charge``: what the
        request body was charged to it (``let_go`` gives both back). ``max_counted``: Config
        ``max_counted_bytes``, the most prompt and completion bytes the tokenizer counts. ``let_go``:
        gives freed heap pages back to the system (``wire.memory.trim``), called while a large response
        is joined, so that the reads already copied do not stay in RSS beside their copy. ``tenant_rule``:
        how the turn's ``tenant`` is named (from the headers, in the measuring thread)."""
        self.id = new_turn_id()  # known before the record is built, so counter deltas can join it
        self.method = method
        self.path = path
        self.body = body
        self.request_bytes = len(body)
        self.body_charge = body_charge
        self._take = take if take is not None else _no_budget
        self.trim_heap = let_go  # for build_record: heap pages back to the system while it joins reads
        self.max_counted = max_counted if max_counted is not None else 1 << 62
        self.shed: list[str] = []  # what was let go of before measuring, to stay within the memory budget
        self.backlog_charge = 0  # the proxy's: what this turn held against the budget when it queued
        self.t_wall = t_wall
        self.t_request = t_request
        self.concurrency = concurrency
        self.label = label
        self.proxy_name = proxy_name
        self.tenant_rule = tenant_rule
        self.instance_id = instance_id
        self.conn_id = conn_id
        self.store_text = store_text
        self.request_encoding = request_encoding
        self.headers = headers
        self.client_header = client_header
        self.measured = measured
        if not measured:
            max_bytes = 0
        self.status: int | None = None
        self.content_type = ""
        self.content_encoding = ""
        self.chunked = False
        self.t_upstream_headers: float | None = None
        self.reads: list[bytes] = []
        self.kept_bytes = 0  # of the reads kept (build_record consumes the list; the budget's charge stays known)
        self.read_times: list[float] = []
        self.write_times: list[float] = []
        self.relayed = None  # reads the relay thread kept (a _relayc.Turn), taken off the loop: take_relayed()
        # bytes of the response still to keep (``max_bytes``); past it reads are relayed, not kept
        self.room = max_bytes if max_bytes is not None else 1 << 62
        self._small_after = self.room - SMALL_KEEP  # the first SMALL_KEEP bytes kept are a small turn's
        self.capped = False
        self.budget_capped = False  # ``capped`` because the memory budget had no room (not ``max_bytes``)
        self.t_done: float | None = None
        self.outcome: str | None = None
        self.error: str | None = None
        self.timing: StreamTiming | None = None  # set by build_record for a stream: the metrics', not stored
        self._ended = False

    # --- the forwarding path (specproxy.recorder.Recorder): cheap, no parsing ------------------------

    @property
    def ended(self) -> bool:
        """``finish`` or ``fail`` was called: the turn's outcome is decided."""
        return self._ended

    def on_headers(
        self, t: float, status: int, content_type: str, content_encoding: str = "", *, chunked: bool = False
    ) -> None:
        """``chunked``: the reads will hold the response's HTTP/1.1 chunked framing as relayed verbatim."""
        assert self.t_upstream_headers is None, "on_headers called twice"
        self.t_upstream_headers = t
        self.status = status
        self.content_type = content_type
        self.content_encoding = content_encoding
        self.chunked = chunked

    def on_bytes(self, data: bytes, t_read: float, t_written: float) -> None:
        """One read relayed. Kept while the kept bytes fit in ``max_bytes``; from the first read that does
        not, none is (the reads kept are the body's first ones, in order) and ``capped`` says so."""
        self.room -= len(data)
        if self.room >= 0 and self._take(len(data), self._small_after <= self.room):
            self.reads.append(data)
            self.kept_bytes += len(data)
            self.read_times.append(t_read)
            self.write_times.append(t_written)
        else:
            if self.room >= 0:  # the process's memory budget is spent: keep nothing more of this body
                self.room = -1
                self.budget_capped = True
            self.capped = True

    def relayed_by_thread(self, turn) -> None:
        """The relay thread relayed the rest of the body: its reads (after those already appended) are in
        ``turn``, and become Python objects in ``take_relayed``, in the measuring thread, not on the loop."""
        self.relayed = turn

    def take_relayed(self) -> None:
        """Append the reads the relay thread kept (once; nothing when it relayed none). Off the loop."""
        turn, self.relayed = self.relayed, None
        if turn is not None:
            before = len(self.reads)
            turn.take(self.reads, self.read_times, self.write_times)
            self.kept_bytes += sum(map(len, self.reads[before:]))
            self.capped = self.capped or turn.capped
            self.budget_capped = self.budget_capped or getattr(turn, "capped_budget", False)

    @property
    def response_kept(self) -> int:
        """Bytes of the response kept for measuring: the reads appended, and those the relay thread still
        holds (before ``take_relayed``, or when it never ran: measuring failed first)."""
        return self.kept_bytes + (self.relayed.kept if self.relayed is not None else 0)

    # --- the memory budget: what this turn holds, and letting go of it -----------------------------

    def charged(self) -> int:
        """Bytes this turn holds against the memory budget: its request body's charge and every response
        read kept (the relay thread's too, taken or not)."""
        kept = self.kept_bytes if self._take is not _no_budget else 0
        if self.relayed is not None:
            kept += self.relayed.kept
        return self.body_charge + kept

    def shed_prompt(self) -> int:
        """Let go of the request body before measuring (the prompt will not be counted; the record keeps
        its size and says why). Returns the bytes given back to the budget."""
        freed, self.body_charge = self.body_charge, 0
        if self.body:
            self.body = b""
            self.shed.append("prompt_memory_budget")
        return freed

    def shed_response(self) -> int:
        """Let go of the response reads before measuring (the record says why: none of its body is read).
        Returns the bytes given back to the budget."""
        freed = self.let_go(body=False)
        self.capped = self.budget_capped = True
        return freed

    def let_go(self, body: bool = True) -> int:
        """After ``build_record`` (or instead of it): drop the response reads, and the body with ``body``, so
        that their memory returns at once. Returns the bytes to give back to the budget."""
        freed = self.kept_bytes if self._take is not _no_budget else 0  # (charged by take alone)
        turn, self.relayed = self.relayed, None
        if turn is not None:
            freed += turn.kept
        self.reads = []
        self.kept_bytes = 0
        if body:
            freed += self.body_charge
            self.body_charge = 0
            self.body = b""
        return freed

    def finish(self, t_done: float, outcome: str = "ok", error: str | None = None) -> None:
        """The response ended (normally, or with an outcome the proxy observed)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.error = error

    def fail(self, t_done: float, outcome: str, status: int | None, error: str) -> None:
        """No response came from the upstream (the client got an error from specproxy itself)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.status = status
        self.error = error

SMALL_KEEP = 64 * 1024  # wire/memory.py's: a turn's first bytes kept may use the whole budget


def _no_budget(n: int, small: bool = False) -> bool:
    return True


