"""The per-turn figures pushed over OTLP/HTTP (protobuf), for a fleet that collects with OpenTelemetry
rather than scraping Prometheus (``serve --otlp-endpoint``).

Why the SDK's own pieces: ``opentelemetry-sdk``'s histograms aggregate in memory and its
``PeriodicExportingMetricReader`` sends them from its own thread every ``otlp_interval_s``, so the event
loop never encodes or sends anything. A turn is recorded where its Record is built, in the measuring
thread (``Service._store``), never on the forwarding path. Temporality is cumulative (the SDK's default):
an export that fails loses nothing, the next one carries the totals.

Names are the OpenTelemetry GenAI semantic conventions' (docs/operations.md, "Fleet", lists them), with
the attributes ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.provider.name`` (the API the
client spoke: ``openai`` for the OpenAI-style APIs, ``anthropic`` for Messages) and ``error.type`` (the
outcome) on a turn that did not end ``ok``; ``specproxy.api`` and ``specproxy.outcome`` are the Prometheus
page's ``api`` and ``outcome`` labels. The same turns and the same values as ``own_metrics.py``'s
histograms: the client's operation duration is also sent as the server's request duration (a proxy
beside the server sees one span for both), time per output token is 1 / per-stream decode speed. The
per-chunk gaps (``time_per_output_chunk``) are not sent: the SDK takes single values, and a stream's gaps
arrive already bucketed. The model string is cut as on the Prometheus page (``MODEL_CHARS``,
``MAX_MODELS``). The shippers' figures are observed at each export, per sink (``specproxy.sink``).

A bad endpoint is said in one line at start (an empty export sent once, in the reader's thread) and
again once each time exporting starts failing; every failed export is counted (``otlp_exports_failed``
on the state line and ``specproxy_otlp_exports_failed`` on /metrics). Forwarding never waits on it.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

from specproxy.errors import ConfigError
from specproxy.measure.chunk_gaps import ADVISED_BOUNDS_S, GAP_BOUNDS_S, StreamTiming
from specproxy.record import Record
from specproxy.serve.own_metrics import MAX_MODELS, MODEL_CHARS, OPERATIONS, OTHER_MODEL, TOKENS, UNKNOWN

__all__ = ["Otlp", "probe"]

log = logging.getLogger("specproxy")

PROVIDERS = {"chat": "openai", "completions": "openai", "responses": "openai", "messages": "anthropic"}
PROBE_TIMEOUT_S = 5.0
SHUTDOWN_MS = 5000
SERVICE = "specproxy"


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


class Otlp:
    """The meter provider, its periodic reader and the instruments. ``record`` from the measuring thread;
    ``close`` once (a last export, bounded)."""

    def __init__(self, endpoint: str, interval_s: float, proxy_name: str, version: str,
                 sinks: Callable[[], dict[str, dict[str, float]]] = dict) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.metrics import Observation
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import (MetricExporter, MetricExportResult,
                                                          PeriodicExportingMetricReader)
            from opentelemetry.sdk.resources import Resource
        except ImportError:
            raise ConfigError("otlp_endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
                              "pip install 'specproxy[otlp]'") from None
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # its retries' tracebacks: ours is one line
        self.endpoint = endpoint
        self.exports = 0
        self.exports_failed = 0
        self._failing = False
        self._models: set[str] = set()
        self._lock = threading.Lock()  # the model set: the measuring thread, and tests' several
        outer = self

        inner = OTLPMetricExporter(endpoint=endpoint, timeout=min(10.0, max(1.0, interval_s)))

        class Counted(MetricExporter):
            """The OTLP exporter, its results counted and its failures said once per run of them."""

            def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
                result = inner.export(metrics_data, timeout_millis=timeout_millis)
                outer._exported(result == MetricExportResult.SUCCESS)
                return result

            def force_flush(self, timeout_millis: float = 10_000) -> bool:
                return inner.force_flush(timeout_millis)

            def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
                inner.shutdown(timeout_millis=timeout_millis)

        self._reader = PeriodicExportingMetricReader(Counted(), export_interval_millis=interval_s * 1000,
                                                     export_timeout_millis=min(10.0, max(1.0, interval_s)) * 1000)
        resource = Resource.create({"service.name": SERVICE, "service.version": version,
                                    "service.instance.id": proxy_name})
        self._provider = MeterProvider(resource=resource, metric_readers=[self._reader])
        meter = self._provider.get_meter("specproxy", version)
        h = meter.create_histogram
        self.duration = h("gen_ai.client.operation.duration", "s", "GenAI operation duration: request read to "
                          "response end, every outcome", explicit_bucket_boundaries_advisory=ADVISED_BOUNDS_S)
        self.server_duration = h("gen_ai.server.request.duration", "s", "Request read to response end, as the "
                                 "proxy beside the server sees it", explicit_bucket_boundaries_advisory=ADVISED_BOUNDS_S)
        self.token_usage = h("gen_ai.client.token.usage", "{token}", "Tokens per turn: input = the prompt as "
                             "the server sees it, output = delivered tokens", explicit_bucket_boundaries_advisory=TOKENS)
        self.first_chunk = h("gen_ai.client.operation.time_to_first_chunk", "s", "Streamed turns: request read "
                             "to the response's first chunk", explicit_bucket_boundaries_advisory=GAP_BOUNDS_S)
        self.first_token = h("gen_ai.server.time_to_first_token", "s", "Streamed turns: request read to the "
                             "first chunk carrying output text", explicit_bucket_boundaries_advisory=GAP_BOUNDS_S)
        self.per_token = h("gen_ai.server.time_per_output_token", "s", "Streamed turns: 1 / per-stream decode "
                           "speed", explicit_bucket_boundaries_advisory=GAP_BOUNDS_S)

        def sink_figure(key: str):
            def observe(_options):
                return [Observation(figures[key], {"specproxy.sink": name}) for name, figures in sinks().items()]
            return observe

        for key, name, kind, desc in (
                ("sink_rows_behind", "specproxy.sink.rows_behind", "gauge", "Local rows the sink has not taken yet"),
                ("sink_seconds_behind", "specproxy.sink.seconds_behind", "gauge",
                 "Age of the oldest turn the sink has not taken yet (0 when none waits)"),
                ("sink_batches_failed", "specproxy.sink.batches_failed", "counter",
                 "Batches the sink took nothing of"),
                ("sink_rows_shipped", "specproxy.sink.rows_shipped", "counter", "Rows the sink took"),
                ("sink_rows_set_aside", "specproxy.sink.rows_set_aside", "counter", "Rows the sink refused")):
            unit = "s" if key == "sink_seconds_behind" else "{row}" if "rows" in key else "{batch}"
            make = meter.create_observable_gauge if kind == "gauge" else meter.create_observable_counter
            make(name, [sink_figure(key)], unit, desc)
        threading.Thread(target=self._say_at_start, name="specproxy-otlp-probe", daemon=True).start()

    def _say_at_start(self) -> None:
        why = probe(self.endpoint)
        if why is not None:
            log.warning("otlp_endpoint %s does not take metrics: %s; forwarding goes on, exports are retried "
                        "every interval and failures counted (otlp_exports_failed)", self.endpoint, why)

    def _exported(self, ok: bool) -> None:
        """In the reader's thread, after each export."""
        self.exports += 1
        if ok:
            if self._failing:
                log.warning("otlp_endpoint %s: exporting again", self.endpoint)
            self._failing = False
            return
        self.exports_failed += 1
        if not self._failing and self.exports > 1:  # the first one's failure was said by the probe at start
            log.warning("otlp_endpoint %s: exporting failed (%s); the figures are kept and sent with the next "
                        "export", self.endpoint, probe(self.endpoint) or "refused")
        self._failing = True

    def _model(self, model: str | None) -> str:
        m = (model or "")[:MODEL_CHARS]
        with self._lock:
            if m in self._models:
                return m
            if len(self._models) < MAX_MODELS:
                self._models.add(m)
                return m
        return OTHER_MODEL

    def record(self, r: Record, timing: StreamTiming | None = None) -> None:
        """One turn the store took, in the measuring thread (the same turns as ``OwnMetrics.record``)."""
        api = r.api or UNKNOWN
        attrs = {"gen_ai.operation.name": OPERATIONS.get(api, UNKNOWN), "gen_ai.request.model": self._model(r.model),
                 "gen_ai.provider.name": PROVIDERS.get(api, UNKNOWN), "specproxy.api": api,
                 "specproxy.outcome": r.outcome}
        if r.outcome != "ok":
            attrs["error.type"] = r.outcome
        if r.completion_tokens is not None:
            self.token_usage.record(r.completion_tokens, {**attrs, "gen_ai.token.type": "output"})
        if r.prompt_tokens is not None:
            self.token_usage.record(r.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
        if r.total_s is not None:
            self.duration.record(r.total_s, attrs)
            self.server_duration.record(r.total_s, attrs)
        if not r.streamed:
            return
        if r.ttft_s is not None:
            self.first_token.record(r.ttft_s, attrs)
        if timing is not None and timing.first_chunk_s is not None:
            self.first_chunk.record(timing.first_chunk_s, attrs)
        if r.decode_tps:
            self.per_token.record(1.0 / r.decode_tps, attrs)

    def close(self) -> None:
        """A last export of what is pending (bounded), then stop the reader's thread. Blocks: not on the loop."""
        self._provider.shutdown(timeout_millis=SHUTDOWN_MS)
