"""specproxy's own metrics, for Prometheus at ``/_specproxy/metrics``.

Why a collector of our own rather than prometheus_client's Histogram objects: a record arrives on the
event loop (the measuring worker hands its batch there), and each observation must cost next to nothing
there; here it is a bisect and two additions, no lock. The one histogram with an observation per chunk
(``time_per_output_chunk``) takes a turn's bucket counts, bucketed in the measuring thread
(``measure/chunk_gaps.py``): a turn costs the loop one addition per bucket, never one step per chunk.
prometheus_client formats the page.

Names follow the OpenTelemetry GenAI semantic conventions as a Prometheus exporter writes them (dots to
underscores, the unit as a suffix) where one exists; figures the conventions do not define are
``specproxy_*``. The conventions' ``time_to_first_chunk`` (to the response's first chunk) and
``time_per_output_chunk`` (one observation per chunk after the first: the time since the previous one)
share one meaning of chunk, an event with data whatever it carries (``measure/chunk_gaps.py``); the
per-token figures (time to first token, time per output token,
per-stream decode speed, tokens per chunk) sit beside them under their own names, never in their place
(docs/operations.md lists every name).

Labels are the model the request named, the API and the outcome: never text, never a header. The API
is the record's ``api`` (``chat``, ``completions``, ``messages``, ``responses``: the four are told
apart) in the label ``api``, and the conventions' ``gen_ai_operation_name`` beside it (``chat``, or
``text_completion`` for completions): a function of the API, so it adds no series. A client chooses the
model string, so it is cut to ``MODEL_CHARS`` and at most ``MAX_MODELS`` distinct ones get their own
series; the rest share ``"other"`` (the series cannot grow without bound).

Across a fleet each proxy's page is scraped as its own target, and PromQL sums them (``sum by (le)``):
so no family carries a label that differs from one process to the next (a proxy's name, its start
time, the upstream's instance id) and would keep two proxies' series apart. Who the proxy is lives in
one info-style gauge, ``specproxy_proxy_info`` (value 1), to join on when wanted. The shippers' figures
carry the sink's name (``sink``): the same URL on every proxy of a fleet, so they sum across proxies too.
"""

from __future__ import annotations

from bisect import bisect_left
from operator import add
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                   Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specproxy.measure.chunk_gaps import ADVISED_BOUNDS_S, GAP_BOUNDS_S, StreamTiming
from specproxy.config import Slo
from specproxy.record import Record
from specproxy.serve.counters import COUNTS, GAUGE, OTLP_COUNTS, SINK_COUNTS
from specproxy.serve.slo_counts import SloCounts

__all__ = ["CONTENT_TYPE", "MAX_MODELS", "OwnMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_MODELS = 32
MODEL_CHARS = 64
OTHER_MODEL = "other"

# the record's api -> the conventions' operation name; a record without one (its measuring failed) is "unknown"
OPERATIONS = {"chat": "chat", "completions": "text_completion", "messages": "chat", "responses": "chat"}
UNKNOWN = "unknown"
LABELS = ("gen_ai_request_model", "gen_ai_operation_name", "api", "outcome")

# bucket bounds: the conventions' advice where they give it; for the two per-chunk times (advised the
# same bounds as the duration) a superset with finer bounds below 0.08 s (chunk_gaps.GAP_BOUNDS_S)
DURATION_S = ADVISED_BOUNDS_S
FIRST_CHUNK_S = GAP_BOUNDS_S
PER_CHUNK_S = GAP_BOUNDS_S
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
SPEED_TPS = (1, 2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 150, 200, 300, 500, 1000)
PER_CHUNK_TOKENS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
PROMPT_PARTS = (("system", "prompt_system_tokens"), ("tools", "prompt_tools_tokens"),
                ("history", "prompt_history_tokens"), ("new", "prompt_new_tokens"))


class _Histogram:
    """Cumulative-at-scrape bucket counts per label values."""

    __slots__ = ("bounds", "doc", "extra", "name", "series")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...], extra: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.bounds, self.extra = name, doc, bounds, extra
        self.series: dict[tuple[str, ...], list] = {}

    def add(self, key: tuple[str, ...], value: float, count: int = 1, total: float | None = None) -> None:
        """``count`` observations of ``value`` (their sum ``total`` when it is known exactly)."""
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [[0] * (len(self.bounds) + 1), 0.0]
        s[0][bisect_left(self.bounds, value)] += count  # le: a value equal to a bound is in its bucket
        s[1] += value * count if total is None else total

    def add_counts(self, key: tuple[str, ...], counts: tuple[int, ...], total: float) -> None:
        """Observations already bucketed by these bounds (``counts``), and their sum."""
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [[0] * (len(self.bounds) + 1), 0.0]
        s[0] = list(map(add, s[0], counts))
        s[1] += total

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=(*LABELS, *self.extra))
        for key, (counts, total) in list(self.series.items()):  # a copy: records may land meanwhile
            running, buckets = 0, []
            for bound, c in zip((*map(_le, self.bounds), "+Inf"), counts):
                running += c
                buckets.append((bound, running))
            fam.add_metric(list(key), buckets, total)
        return fam


def _le(bound: float) -> str:
    return repr(float(bound))


class OwnMetrics:
    """Fed one record at a time (``record``, on the loop); read by ``exposition`` (Prometheus text).

    ``state``: the live counts read at scrape time (in flight, dropped, scrape failures...), so that
    nothing is counted twice and the forwarding path does no extra work for them."""

    def __init__(self, state: Callable[[], dict[str, float]] = dict,
                 sinks: Callable[[], dict[str, dict[str, float]]] = dict,
                 identity: Callable[[], dict[str, str]] = dict, slo: Slo | None = None) -> None:
        """``sinks``: each sink's figures by its name (``Counters.read_sinks``); ``identity``: who this proxy
        is (proxy name, version, the upstream's instance id), shown only in ``specproxy_proxy_info``;
        ``slo``: serve's objective, whose judged turns ``specproxy_slo_turns`` counts (``slo_counts.py``)."""
        self.slo = SloCounts(slo, LABELS) if slo is not None else None
        self._state = state
        self._sinks = sinks
        self._identity = identity
        self._models: set[str] = set()
        self.turns: dict[tuple[str, ...], int] = {}
        self.tokens: dict[tuple[str, ...], float] = {}
        h = _Histogram
        self.duration = h("gen_ai_client_operation_duration_seconds",
                          "GenAI operation duration: request read to response end, every outcome", DURATION_S)
        self.token_usage = h("gen_ai_client_token_usage",
                             "Tokens per turn, counted with the model's tokenizer: input = the prompt as the "
                             "server sees it, output = delivered tokens", TOKENS, ("gen_ai_token_type",))
        self.first_chunk = h("gen_ai_client_operation_time_to_first_chunk_seconds",
                             "Streamed turns: request read to the response's first chunk (an event with "
                             "data, whatever it carries: a role-only chunk counts)", FIRST_CHUNK_S)
        self.first_token = h("specproxy_time_to_first_token_seconds",
                             "Streamed turns: request read to the first chunk carrying output text (TTFT)",
                             FIRST_CHUNK_S)
        self.per_chunk = h("gen_ai_client_operation_time_per_output_chunk_seconds",
                           "Streamed turns: one observation per chunk (an event with data, [DONE] too) "
                           "after the first, the time since the previous one (0 for chunks that arrived in "
                           "one read)", PER_CHUNK_S)
        self.per_token = h("specproxy_time_per_output_token_seconds",
                           "Streamed turns: 1 / per-stream decode speed (tokens after the first chunk over "
                           "decode time), one observation per turn", PER_CHUNK_S)
        self.decode_time = h("specproxy_decode_duration_seconds",
                             "Streamed turns: first to last text-carrying chunk", DURATION_S)
        self.decode_speed = h("specproxy_decode_speed_tokens_per_second",
                              "Streamed turns: per-stream decode speed", SPEED_TPS)
        self.tokens_per_chunk = h("specproxy_tokens_per_chunk",
                                  "Streamed turns: delivered tokens / text-carrying chunks", PER_CHUNK_TOKENS)
        self.prompt_parts = h("specproxy_prompt_part_tokens",
                              "Prompt make-up per turn: system, tools, history, new", TOKENS, ("part",))
        self.histograms = (self.duration, self.token_usage, self.first_chunk, self.first_token, self.per_chunk,
                           self.per_token,
                           self.decode_time, self.decode_speed, self.tokens_per_chunk, self.prompt_parts)

    def _model(self, model: str | None) -> str:
        m = (model or "")[:MODEL_CHARS]
        if m in self._models:
            return m
        if len(self._models) < MAX_MODELS:
            self._models.add(m)
            return m
        return OTHER_MODEL

    def record(self, r: Record, timing: StreamTiming | None = None) -> None:
        """One turn the store took (the sink's call, on the loop); ``timing``: its stream's per-chunk
        times, bucketed in the measuring thread."""
        api = r.api or UNKNOWN
        key = (self._model(r.model), OPERATIONS.get(api, UNKNOWN), api, r.outcome)
        self.turns[key] = self.turns.get(key, 0) + 1
        if r.completion_tokens is not None:
            self.tokens[key] = self.tokens.get(key, 0) + r.completion_tokens
            self.token_usage.add((*key, "output"), r.completion_tokens)
        if r.prompt_tokens is not None:
            self.token_usage.add((*key, "input"), r.prompt_tokens)
        if r.total_s is not None:
            self.duration.add(key, r.total_s)
        if self.slo is not None:
            self.slo.add(key, r)
        for part, field in PROMPT_PARTS:
            v = getattr(r, field)
            if v is not None:
                self.prompt_parts.add((*key, part), v)
        if not r.streamed:
            return
        if r.ttft_s is not None:
            self.first_token.add(key, r.ttft_s)
        if timing is not None:
            if timing.first_chunk_s is not None:
                self.first_chunk.add(key, timing.first_chunk_s)
            if timing.gap_counts is not None:
                self.per_chunk.add_counts(key, timing.gap_counts, timing.gap_sum)
        if r.decode_s is not None:
            self.decode_time.add(key, r.decode_s)
        if r.decode_tps:
            self.decode_speed.add(key, r.decode_tps)
            self.per_token.add(key, 1.0 / r.decode_tps)
        if r.tokens_per_chunk is not None:
            self.tokens_per_chunk.add(key, r.tokens_per_chunk)

    def collect(self) -> Iterator[Metric]:
        turns = CounterMetricFamily("specproxy_turns", "Measured turns the store took, by outcome: its rows "
                                    "once written (specproxy_store_queue_records wait; turns it dropped are "
                                    "specproxy_dropped_records_store)", labels=LABELS)
        for key, n in list(self.turns.items()):
            turns.add_metric(list(key), n)
        yield turns
        tokens = CounterMetricFamily("specproxy_delivered_tokens", "Output tokens delivered to clients",
                                     labels=LABELS)
        for key, n in list(self.tokens.items()):
            tokens.add_metric(list(key), n)
        yield tokens
        for h in self.histograms:
            yield h.family()
        if self.slo is not None:
            yield self.slo.family()
        yield from _state_families(self._state())
        yield from _sink_families(self._sinks())
        identity = self._identity()
        if identity:
            info = InfoMetricFamily("specproxy_proxy", "Who this proxy is (value 1): labels that differ from one "
                                    "process to the next live here only, never on the figures", labels=sorted(identity))
            info.add_metric([identity[k] for k in sorted(identity)], {})
            yield info

    def exposition(self) -> bytes:
        """The Prometheus page. Safe in a thread while ``record`` runs on the loop: it reads copies (a scrape
        may see a turn in one family and not yet in the next, as with any live exporter)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)


def _state_families(state: dict[str, float]) -> Iterable[Metric]:
    for key, name, doc, kind in (*COUNTS, *OTLP_COUNTS):
        if name is not None and key in state:
            cls = GaugeMetricFamily if kind == GAUGE else CounterMetricFamily
            yield cls(name, doc, value=state[key])


def _sink_families(sinks: dict[str, dict[str, float]]) -> Iterable[Metric]:
    """The shippers' figures, one series per sink (none without a sink: zeros would read as keeping up)."""
    if not sinks:
        return
    for key, name, doc, kind in SINK_COUNTS:
        assert name is not None
        cls = GaugeMetricFamily if kind == GAUGE else CounterMetricFamily
        fam = cls(name, doc, labels=("sink",))
        for sink, figures in sinks.items():
            fam.add_metric([sink], figures[key])
        yield fam
