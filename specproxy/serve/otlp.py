"""The per-turn figures pushed over OTLP/HTTP (protobuf), for a fleet that collects with OpenTelemetry
rather than scraping Prometheus (``serve --otlp-endpoint``).

Why no OpenTelemetry instruments: the figures are already aggregated once, by ``OwnMetrics`` (a bisect
and two additions per observation, the per-chunk gaps bucketed in the measuring thread), and the SDK's
histograms would aggregate every turn a second time, at about 17 µs of interpreter time per observation
(its attribute checks and hashing: some 120 µs a turn for seven figures, measured), competing with the
relay for the interpreter lock. So this module is another exposition of ``OwnMetrics``, as the Prometheus
page is: every ``otlp_interval_s`` its own thread copies the histograms (as a scrape does), builds the
SDK's ``MetricsData`` and hands it to the SDK's ``OTLPMetricExporter`` (protobuf over HTTP, its retries
and timeout). Nothing is added to a turn's path; the event loop never encodes or sends. Temporality is
cumulative: an export that fails loses nothing, the next one carries the totals.

Names are the OpenTelemetry GenAI semantic conventions' (docs/operations.md, "Fleet", lists them), with
the attributes ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.provider.name`` (the API the
client spoke: ``openai`` for the OpenAI-style APIs, ``anthropic`` for Messages) and ``error.type`` (the
outcome) on a turn that did not end ``ok``; ``specproxy.api`` and ``specproxy.outcome`` are the Prometheus
page's ``api`` and ``outcome`` labels. The same series, bounds and values as the Prometheus page; the
client's operation duration is also sent as the server's request duration (a proxy beside the server
sees one duration for both). The shippers' figures go per sink (``specproxy.sink``).

A bad endpoint is said in one line at start (an empty export sent once, from the exporting thread) and
again once each time exporting starts failing; every failed export is counted (``otlp_exports_failed``
on the state line and ``specproxy_otlp_exports_failed`` on /metrics). Forwarding never waits on it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from specproxy.errors import ConfigError
from specproxy.serve.own_metrics import LABELS, OwnMetrics
from specproxy.wire.os_thread import name_os_thread

__all__ = ["Otlp", "probe"]

log = logging.getLogger("specproxy")

PROVIDERS = {"chat": "openai", "completions": "openai", "responses": "openai", "messages": "anthropic"}
PROBE_TIMEOUT_S = 5.0
SERVICE = "specproxy"

# (OTLP name, unit, what, the OwnMetrics histogram it reads)
HISTOGRAMS = (
    ("gen_ai.client.operation.duration", "s", "GenAI operation duration: request read to response end, every "
     "outcome", "duration"),
    ("gen_ai.server.request.duration", "s", "Request read to response end, as the proxy beside the server sees "
     "it", "duration"),
    ("gen_ai.client.token.usage", "{token}", "Tokens per turn: input = the prompt as the server sees it, output = "
     "delivered tokens", "token_usage"),
    ("gen_ai.client.operation.time_to_first_chunk", "s", "Streamed turns: request read to the response's first "
     "chunk (an event with data, whatever it carries)", "first_chunk"),
    ("gen_ai.client.operation.time_per_output_chunk", "s", "Streamed turns: one observation per chunk after the "
     "first, the time since the previous one", "per_chunk"),
    ("gen_ai.server.time_to_first_token", "s", "Streamed turns: request read to the first chunk carrying output "
     "text", "first_token"),
    ("gen_ai.server.time_per_output_token", "s", "Streamed turns: 1 / per-stream decode speed", "per_token"),
    ("specproxy.decode.speed", "{token}/s", "Streamed turns: per-stream decode speed", "decode_speed"),
    ("specproxy.prompt.part_tokens", "{token}", "Prompt make-up per turn: system, tools, history, new",
     "prompt_parts"),
)
# Prometheus label -> OTLP attribute, for the labels past LABELS
EXTRA = {"gen_ai_token_type": "gen_ai.token.type", "part": "specproxy.prompt.part"}
# (the sink figure's key, OTLP name, unit, what, monotonic: a counter, else a gauge)
SINK_FIGURES = (
    ("sink_rows_behind", "specproxy.sink.rows_behind", "{row}", "Local rows the sink has not taken yet", False),
    ("sink_seconds_behind", "specproxy.sink.seconds_behind", "s",
     "Age of the oldest turn the sink has not taken yet (0 when none waits)", False),
    ("sink_rows_shipped", "specproxy.sink.rows_shipped", "{row}", "Rows the sink took", True),
    ("sink_batches_failed", "specproxy.sink.batches_failed", "{batch}", "Batches the sink took nothing of", True),
    ("sink_rows_set_aside", "specproxy.sink.rows_set_aside", "{row}", "Rows the sink refused", True),
)


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` does not take an OTLP metrics export (an empty one is sent), or None when it does."""
    req = urllib.request.Request(url, b"", {"Content-Type": "application/x-protobuf"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the operator's own URL
            resp.read()
        return None
    except urllib.error.HTTPError as exc:
        return f"it answers HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"cannot connect ({reason})".replace("\n", " ")


def attributes(key: tuple[str, ...], extra: tuple[str, ...]) -> dict[str, str]:
    """A series' labels (``LABELS`` then ``extra``, as ``OwnMetrics`` keys them) as OTLP attributes."""
    model, operation, api, outcome = key[:len(LABELS)]
    out = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
           "gen_ai.provider.name": PROVIDERS.get(api, "unknown"), "specproxy.api": api, "specproxy.outcome": outcome}
    if outcome != "ok":
        out["error.type"] = outcome
    for name, value in zip(extra, key[len(LABELS):]):
        out[EXTRA[name]] = value
    return out


class Otlp:
    """Exports ``metrics`` (and the sinks' figures) every ``interval_s`` from its own thread: ``start``, then
    ``close`` (one last export, bounded by the exporter's timeout). ``exports`` and ``exports_failed`` are
    read from any thread."""

    def __init__(self, endpoint: str, interval_s: float, proxy_name: str, version: str,
                 metrics: Callable[[], OwnMetrics | None],
                 sinks: Callable[[], dict[str, dict[str, float]]] = dict) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import MetricExportResult
            from opentelemetry.sdk.resources import Resource
        except ImportError:
            raise ConfigError("otlp_endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
                              "pip install 'specproxy[otlp]'") from None
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # its retries' tracebacks: ours is one line
        self.endpoint, self.interval_s, self.version = endpoint, interval_s, version
        self._metrics, self._sinks = metrics, sinks
        self._ok = MetricExportResult.SUCCESS
        self._exporter = OTLPMetricExporter(endpoint=endpoint, timeout=min(10.0, max(1.0, interval_s)))
        # built as is, no resource detectors (Resource.create runs them in a thread pool)
        self._resource = Resource({"service.name": SERVICE, "service.version": version,
                                   "service.instance.id": proxy_name})
        self._start_ns = time.time_ns()  # the cumulative series' start: the figures count from here
        self.exports = 0
        self.exports_failed = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specproxy-otlp", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """One last export of the totals (bounded), then stop. Blocks: not on the loop."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self._exporter.shutdown()

    def _run(self) -> None:
        name_os_thread()  # its CPU told apart from the others' (top -H, scripts/bench_overhead.py)
        why = probe(self.endpoint)
        if why is not None:
            log.warning("otlp_endpoint %s does not take metrics: %s; forwarding goes on, exports are retried "
                        "every %g s and failures counted (otlp_exports_failed)", self.endpoint, why, self.interval_s)
        self._failing = why is not None
        while not self._stop.wait(self.interval_s):
            self.export()
        self.export()

    def export(self) -> bool:
        """Send the totals now (in the exporting thread, or a test's); whether the endpoint took them."""
        try:
            ok = self._exporter.export(self.data()) == self._ok
        except Exception as exc:  # noqa: BLE001 - a bug (ours or the SDK's) must not end the thread: counted
            log.error("otlp export failed: %s", type(exc).__name__)
            ok = False
        self.exports += 1
        if ok:
            if self._failing:
                log.warning("otlp_endpoint %s: exporting again", self.endpoint)
            self._failing = False
            return True
        self.exports_failed += 1
        if not self._failing:
            log.warning("otlp_endpoint %s: exporting failed (%s); the totals are sent with the next export",
                        self.endpoint, probe(self.endpoint) or "refused")
        self._failing = True
        return False

    def data(self):
        """The SDK's ``MetricsData`` for the totals now: each histogram copied as a scrape copies it."""
        from opentelemetry.sdk.metrics.export import (AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
                                                      Metric, MetricsData, NumberDataPoint, ResourceMetrics,
                                                      ScopeMetrics, Sum)
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        cumulative = AggregationTemporality.CUMULATIVE
        start, now = self._start_ns, time.time_ns()
        out = []
        metrics = self._metrics()
        if metrics is not None:
            for name, unit, what, attr in HISTOGRAMS:
                h = getattr(metrics, attr)
                points = []
                for key, (counts, total) in list(h.series.items()):  # copies: records may land meanwhile
                    counts = list(counts)
                    points.append(HistogramDataPoint(attributes(key, h.extra), start, now, sum(counts), total, counts,
                                                     list(h.bounds), None, None))
                if points:
                    out.append(Metric(name, what, unit, Histogram(points, cumulative)))
        for key, name, unit, what, monotonic in SINK_FIGURES:
            points = [NumberDataPoint({"specproxy.sink": sink}, start, now, figures[key])
                      for sink, figures in self._sinks().items()]
            if points:
                out.append(Metric(name, what, unit, Sum(points, cumulative, True) if monotonic else Gauge(points)))
        scope = ScopeMetrics(InstrumentationScope("specproxy", self.version), out, "")
        return MetricsData([ResourceMetrics(self._resource, [scope], "")])
