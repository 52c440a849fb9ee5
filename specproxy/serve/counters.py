"""Every count the running proxy keeps of itself, defined once: the state line, ``/_specproxy/metrics``
and the live page's store line all read ``Counters.read``.

Why one object: the fronts (lane, aiohttp's server), the proxy and the service each see part of what
happens to a request (refused before it was read, refused at the gate, measured less, dropped), and an
operator needs all of it in one place under one name. Each count is changed by one method, on the event
loop. The store's and the server watch's counts stay with the objects that keep them (the writer thread,
the scraper) and are read from them here, never copied.

``COUNTS`` is the one list: each count's key (the state line's), its Prometheus name (None: the state
line only) and what it means (docs/operations.md lists the same names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from specproxy.wire import memory

__all__ = ["COUNTS", "OTLP_COUNTS", "SINK_COUNTS", "Counters", "OtlpCounts", "SinkCounts", "StoreCounts"]

GAUGE, COUNTER = "gauge", "counter"

# (key, Prometheus name or None, what it means, kind)
COUNTS: tuple[tuple[str, str | None, str, str], ...] = (
    ("in_flight", "specproxy_requests_in_flight", "Requests being forwarded now", GAUGE),
    ("measured_in_flight", "specproxy_measured_requests_in_flight",
     "Generation requests in flight (the operating point the upstream sees)", GAUGE),
    ("queued", "specproxy_store_queue_records",
     "Records waiting for the database writer (queued, and a batch it retries)", GAUGE),
    ("written", None, "Records the database writer wrote", COUNTER),
    ("dropped", "specproxy_dropped_records_store",
     "Records the store never wrote: its queue was full, or they were still unwritten at shutdown", COUNTER),
    ("write_failures", "specproxy_store_write_failures",
     "Database writes refused (full disk, locked, read-only): the records wait and are retried", COUNTER),
    ("text_shed", "specproxy_store_text_shed",
     "Records queued for the database without their text: the memory budget's share for the queue was full",
     COUNTER),
    ("captures_shed", "specproxy_store_captures_shed",
     "Captured request bodies not queued for the database: the memory budget's share for the queue was full",
     COUNTER),
    ("measure_dropped", "specproxy_dropped_records_measure",
     "Turns forwarded but not measured (too many waiting to be measured)", COUNTER),
    ("measure_errors", "specproxy_measure_errors", "Turns whose measuring failed (recorded unmeasured)", COUNTER),
    ("scrape_failures", "specproxy_scrape_failures", "Failed polls of the upstream's metrics", COUNTER),
    ("rejected_busy", "specproxy_rejected_busy", "Requests answered 503 over max_concurrent", COUNTER),
    ("rejected_bad", "specproxy_rejected_bad", "Malformed, ambiguous, too large or too slow requests", COUNTER),
    ("rejected_memory", "specproxy_rejected_memory",
     "Request bodies answered 503 unread: the memory budget had no room for them", COUNTER),
    ("measure_shed", "specproxy_measure_shed",
     "Finished turns that let go of their body (or response) before measuring, to stay within the memory "
     "budget", COUNTER),
    ("header_timeouts", None,
     "Connections closed because their first request's headers came too slowly (header_timeout_s)", COUNTER),
    ("memory_used", "specproxy_memory_used_bytes",
     "Bytes charged to the memory budget: request bodies, kept response bytes, turns waiting to be measured, "
     "pipelined requests, texts and captured bodies waiting for the database", GAUGE),
    ("memory_budget", "specproxy_memory_budget_bytes", "The memory budget (memory_budget_bytes)", GAUGE),
)

# the shippers' figures (``store/shipper.py``): per sink on /metrics (label ``sink``, ``read_sinks``), summed
# over the sinks on the state line (the most for seconds behind, ``read``); only when ``serve --sink`` names one
SINK_COUNTS: tuple[tuple[str, str | None, str, str], ...] = (
    ("sink_rows_behind", "specproxy_sink_rows_behind",
     "Local rows (turns, scrapes, counter joins) a sink has not taken yet, over every sink", GAUGE),
    ("sink_seconds_behind", "specproxy_sink_seconds_behind",
     "Age of the oldest turn a sink has not taken yet (0 when none waits), the most over every sink", GAUGE),
    ("sink_rows_shipped", "specproxy_sink_rows_shipped", "Rows the sinks took", COUNTER),
    ("sink_batches_failed", "specproxy_sink_batches_failed",
     "Batches a sink took nothing of (unreachable, credentials, permissions): the rows wait locally", COUNTER),
    ("sink_rows_set_aside", "specproxy_sink_rows_set_aside",
     "Rows a sink refused (a constraint, a value out of range): set aside with the reason in sink_refused",
     COUNTER),
)

# the OTLP exporter's figures (``serve/otlp.py``): in ``read`` only when ``serve --otlp-endpoint`` names one
OTLP_COUNTS: tuple[tuple[str, str | None, str, str], ...] = (
    ("otlp_exports", "specproxy_otlp_exports", "Exports to the OTLP endpoint, every interval (otlp_interval_s)",
     COUNTER),
    ("otlp_exports_failed", "specproxy_otlp_exports_failed",
     "Exports the OTLP endpoint did not take (unreachable, refused): the next export carries the totals", COUNTER),
)

Rejection = Literal["busy", "bad", "memory"]


class StoreCounts(Protocol):
    """What the counters read of the store's writer (``store.writer.Writer``)."""

    written: int
    dropped: int
    write_failures: int
    text_shed: int
    captures_shed: int

    @property
    def pending(self) -> int: ...


class SinkCounts(Protocol):
    """What the counters read of each sink's shipper (``store.shipper.Shipper``)."""

    rows_shipped: int
    batches_failed: int
    rows_set_aside: int

    @property
    def name(self) -> str:
        """The sink's URL without a password (``Sink.name``)."""

    @property
    def rows_behind(self) -> int: ...

    @property
    def seconds_behind(self) -> float: ...


class OtlpCounts(Protocol):
    """What the counters read of the OTLP exporter (``serve.otlp.Otlp``)."""

    exports: int
    exports_failed: int


class Counters:
    """The proxy's own counts, changed through its methods (on the loop) but for the two gauges of requests
    in flight, which ``Proxy.exchange`` and ``Proxy.forward`` move themselves, and the store's and the server
    watch's read beside them (``read``). ``store`` and ``scrape_failures`` are where those live; the
    memory budget is the proxy's (set once it is known, ``memory_budget``)."""

    __slots__ = ("header_timeouts", "in_flight", "measure_dropped", "measure_errors", "measure_shed",
                 "measured_in_flight", "memory_budget", "rejected_bad", "rejected_busy", "rejected_memory",
                 "otlp", "scrape_failures", "sinks", "store")

    def __init__(self, store: StoreCounts | None = None, scrape_failures: Callable[[], int] = lambda: 0,
                 sinks: Sequence[SinkCounts] = (), otlp: OtlpCounts | None = None) -> None:
        self.store = store
        self.otlp = otlp
        self.sinks = sinks
        self.scrape_failures = scrape_failures
        self.in_flight = 0  # every request being handled (``Proxy.exchange``)
        self.measured_in_flight = 0  # measured turns in flight: the operating point the upstream sees (``Proxy.forward``)
        self.rejected_busy = 0
        self.rejected_bad = 0  # malformed, ambiguous, too large or too slow requests, never forwarded
        self.rejected_memory = 0  # request bodies refused (503) because the memory budget had no room
        self.measure_dropped = 0
        self.measure_errors = 0
        self.measure_shed = 0  # finished turns that let go of their body (or response) to stay within the budget
        self.header_timeouts = 0
        self.memory_budget = 0

    # --- the changes, each in one place -----------------------------------------------------------

    def rejected(self, why: Rejection) -> None:
        """A request refused before it was forwarded: over ``max_concurrent`` (busy), malformed, ambiguous,
        too large or too slow (bad), or its body had no room in the memory budget (memory)."""
        if why == "bad":
            self.rejected_bad += 1
        elif why == "busy":
            self.rejected_busy += 1
        else:
            self.rejected_memory += 1

    def header_timed_out(self) -> None:
        self.header_timeouts += 1

    def measure_dropped_one(self) -> None:
        self.measure_dropped += 1

    def measure_failed(self) -> None:
        self.measure_errors += 1

    def measure_shed_one(self) -> None:
        self.measure_shed += 1

    # --- reading ----------------------------------------------------------------------------------

    def read(self) -> dict[str, float]:
        """Every count of ``COUNTS`` (and ``SINK_COUNTS`` with a sink, ``OTLP_COUNTS`` with an OTLP endpoint),
        now. Safe from any thread: it reads numbers."""
        w, o = self.store, self.otlp
        otlp = {} if o is None else {"otlp_exports": o.exports, "otlp_exports_failed": o.exports_failed}
        return {**self._counts(w), **self._sink_counts(), **otlp}

    def read_sinks(self) -> dict[str, dict[str, float]]:
        """Each sink's figures of ``SINK_COUNTS``, by the sink's name (its URL without a password): what
        /metrics shows under the label ``sink``, so that a lagging sink is not hidden by one keeping up."""
        return {s.name: {"sink_rows_behind": s.rows_behind, "sink_seconds_behind": s.seconds_behind,
                         "sink_rows_shipped": s.rows_shipped, "sink_batches_failed": s.batches_failed,
                         "sink_rows_set_aside": s.rows_set_aside} for s in self.sinks}

    def _sink_counts(self) -> dict[str, float]:
        each = list(self.read_sinks().values())
        if not each:
            return {}
        return {key: (max if key == "sink_seconds_behind" else sum)(s[key] for s in each)
                for key, *_ in SINK_COUNTS}

    def _counts(self, w: StoreCounts | None) -> dict[str, float]:
        return {
            "in_flight": self.in_flight,
            "measured_in_flight": self.measured_in_flight,
            "queued": w.pending if w is not None else 0,  # waiting for the writer: queued, and a batch it retries
            "written": w.written if w is not None else 0,
            "dropped": w.dropped if w is not None else 0,
            "write_failures": w.write_failures if w is not None else 0,  # the database refused (logged per cause)
            "text_shed": w.text_shed if w is not None else 0,  # records queued without their text: the budget was full
            "captures_shed": w.captures_shed if w is not None else 0,  # captured bodies not queued: the budget was full
            "measure_dropped": self.measure_dropped,
            "measure_errors": self.measure_errors,
            "scrape_failures": self.scrape_failures(),
            "rejected_busy": self.rejected_busy,
            "rejected_bad": self.rejected_bad,
            "rejected_memory": self.rejected_memory,
            "measure_shed": self.measure_shed,
            "header_timeouts": self.header_timeouts,
            "memory_used": memory.used(),  # bytes charged to the memory budget now
            "memory_budget": self.memory_budget,
        }
