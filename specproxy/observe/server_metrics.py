"""What an inference server's own Prometheus counters say, as plain data (sans-I/O).

Why this module exists: a server's throughput figure and the tokens a user receives are
different quantities (in one measured case: 40.7 tok/s in the server's log, 29.4 from its accepted-token
counter, 27.8 delivered to the client). specproxy measures the delivered side itself; this module reads the
*server's* side so the two can be put next to each other and the mean acceptance length (MAL)
can be taken from the server's counters, as docs/metrics.md asks. Everything here is pure: text in,
frozen values out. The I/O (polling, instance identity) lives in ``specproxy.observe.scrape``.

The pieces, top to bottom:

- ``parse_exposition(text) -> Snapshot``: the Prometheus text format, parsed with
  ``prometheus_client``'s own parser (never substrings), normalized per server kind.
- counter deltas, windows and restarts live in ``specproxy.observe.counters``.

What each server's counters count (read in the servers' sources, see the notes on each field of
``Snapshot`` and ``CounterDelta``) differs, and the differences matter for reading them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple


from specproxy.errors import UpstreamError

__all__ = ["RawSample", "ScrapeError", "ServerKind", "Snapshot", "parse_exposition"]

ServerKind = Literal["vllm", "llamacpp", "sglang", "unknown"]


class ScrapeError(UpstreamError):
    """The one error this module (and ``specproxy.observe.scrape``) raises: the text is not a Prometheus
    exposition, or a scrape could not produce one.

    It is one type so that a caller needs one ``except``; the message says what was wrong in
    one line (the parser's own words included), never a traceback's worth. It sits under
    ``UpstreamError`` in specproxy's one exception tree: a page that is not an exposition is an
    upstream that "is not what it should be". The ``Scraper`` never lets it escape; it counts it.
    """


class RawSample(NamedTuple):
    """One sample exactly as exposed (after ``prometheus_client``'s parse). ``labels`` is a
    sorted tuple of pairs so the sample is hashable and has one canonical form to store."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


# --------------------------------------------------------------------------------------------
# Which exposed metric feeds which normalized field, per server kind.
#
# Names are the *base* (without ``_total``): ``_lookup`` tries ``base_total`` then ``base``,
# because the same counter reaches us in several shapes. prometheus_client's parser renames
# the samples of a ``TYPE counter`` family to end in ``_total`` (and strips ``_total`` from the
# family name), while a server that types its counter as ``gauge`` or leaves it untyped keeps
# whatever name it printed (llama.cpp's first spec-decode PR printed
# ``llamacpp:spec_decode_num_drafts`` without the suffix). Looking samples up by sample name,
# not family name, handles every combination.
# --------------------------------------------------------------------------------------------

_FIELD_SOURCES: dict[str, dict[str, str]] = {
    # vLLM V1: vllm/v1/metrics/loggers.py (PrometheusStatLogger) and
    # vllm/v1/spec_decode/metrics.py (SpecDecodingProm). Labels: model_name, engine (DP index).
    "vllm": {
        "requests_running": "vllm:num_requests_running",
        "requests_waiting": "vllm:num_requests_waiting",
        "generation_tokens_total": "vllm:generation_tokens",
        "prompt_tokens_total": "vllm:prompt_tokens",
        "spec_drafts_total": "vllm:spec_decode_num_drafts",
        "spec_draft_tokens_total": "vllm:spec_decode_num_draft_tokens",
        "spec_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens",
        "spec_accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
        # prompt tokens looked up in the prefix cache, and those found (vllm/v1/metrics/loggers.py)
        "prefix_cache_queries_total": "vllm:prefix_cache_queries",
        "prefix_cache_hits_total": "vllm:prefix_cache_hits",
    },
    # llama.cpp: tools/server/server-task.cpp, server_task_result_metrics::to_metrics()
    # (spec-decode counters since PR #26389; per-position counter only after the first
    # speculative request completes). No labels upstream; some builds add ``model``.
    "llamacpp": {
        "requests_running": "llamacpp:requests_processing",
        "requests_waiting": "llamacpp:requests_deferred",
        "generation_tokens_total": "llamacpp:tokens_predicted",
        "prompt_tokens_total": "llamacpp:prompt_tokens",
        "spec_drafts_total": "llamacpp:spec_decode_num_drafts",
        "spec_draft_tokens_total": "llamacpp:spec_decode_num_draft_tokens",
        "spec_accepted_tokens_total": "llamacpp:spec_decode_num_accepted_tokens",
        "spec_accepted_per_pos": "llamacpp:spec_decode_num_accepted_tokens_per_pos",
        # prompt tokens reused from a slot's cache (``n_prompt_cached``); its prompt_tokens counter excludes
        # them, so the lookups are the two added (``parse_exposition``)
        "prefix_cache_hits_total": "llamacpp:prompt_tokens_cached",
    },
    # SGLang: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector gauges,
    # TokenizerMetricsCollector counters). Speculative decoding is exposed as gauges only.
    "sglang": {
        "requests_running": "sglang:num_running_reqs",
        "requests_waiting": "sglang:num_queue_reqs",
        "generation_tokens_total": "sglang:generation_tokens",
        "prompt_tokens_total": "sglang:prompt_tokens",
        "spec_accept_length": "sglang:spec_accept_length",
        "spec_accept_rate": "sglang:spec_accept_rate",
    },
}

_PREFIXES: dict[str, ServerKind] = {"vllm:": "vllm", "llamacpp:": "llamacpp", "sglang:": "sglang"}

# Labels that name a *replica* of the same work rather than a share of it. SGLang's scheduler
# series carry tp_rank/pp_rank/... and every tensor- or pipeline-parallel rank that reports sees
# the same requests, so summing them would count each request once per rank. We keep the
# lowest rank of each such label and sum over the rest (dp_rank, vLLM's ``engine``, model
# labels), which are genuinely different requests.
_REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "attn_cp_rank", "cp_rank")

_MODEL_LABELS = ("model_name", "model")

_SKIP_TYPES = frozenset({"histogram", "summary", "gaugehistogram"})


@dataclass(frozen=True)
class Snapshot:
    """One ``/metrics`` page, normalized. Frozen: a snapshot is a fact about one moment.

    Every normalized field is ``None`` when the server does not expose it (never 0: a zero
    would read "nothing happened" where the truth is "we cannot know"). Counters that appear
    under several label sets (``model_name``, vLLM's ``engine``, SGLang's ``dp_rank``) are
    summed; NaN and infinite values are treated as missing. ``raw`` keeps every sample, so an
    unknown server loses nothing and a later reader can recompute anything.
    """

    server_kind: ServerKind
    #: Requests the engine is running now (vLLM ``num_requests_running``, llama.cpp
    #: ``requests_processing`` = busy slots, SGLang ``num_running_reqs``). The operating point.
    requests_running: float | None = None
    #: Requests queued (vLLM ``num_requests_waiting``, llama.cpp ``requests_deferred``,
    #: SGLang ``num_queue_reqs``).
    requests_waiting: float | None = None
    #: The server's generation-token counter; what it counts differs per server, see
    #: ``CounterDelta.generated_tokens``.
    generation_tokens_total: float | None = None
    #: The server's prompt-token counter. vLLM and SGLang count whole prompts, cached prefix
    #: included; llama.cpp counts only the tokens it computed (cache hits excluded).
    prompt_tokens_total: float | None = None
    #: Verification passes that checked a draft (vLLM ``num_drafts``; llama.cpp
    #: ``num_drafts`` = "verification steps").
    spec_drafts_total: float | None = None
    #: Draft tokens proposed.
    spec_draft_tokens_total: float | None = None
    #: Draft tokens the target model accepted. Excludes the one token each verification pass
    #: produces itself (the "bonus"/correction token); that is why MAL is ``1 + accepted/drafts``.
    spec_accepted_tokens_total: float | None = None
    #: Accepted tokens per draft position (0-based), summed over other labels. vLLM always
    #: (when speculating); llama.cpp only after its first speculative request completed.
    spec_accepted_per_pos: Mapping[int, float] | None = None
    #: SGLang gauge: tokens emitted per verification pass over the last decode log interval
    #: (accepted drafts + the bonus token, over forward count: scheduler_metrics_mixin
    #: ``update_spec_metrics``), so it is comparable to MAL but not windowed like a counter.
    #: 0 means no speculative decoding. Mean over replica-deduplicated label sets.
    spec_accept_length: float | None = None
    #: SGLang gauge: accepted/draft tokens over the last decode log interval (its exact
    #: numerator has changed between SGLang versions; prefer counters where a server has them).
    spec_accept_rate: float | None = None
    #: Prompt tokens the server looked up in its prefix cache (vLLM ``prefix_cache_queries``; llama.cpp
    #: ``prompt_tokens`` + ``prompt_tokens_cached``: its prompt counter leaves the cached ones out).
    prefix_cache_queries_total: float | None = None
    #: Of those, the tokens found in the cache (vLLM ``prefix_cache_hits``, llama.cpp
    #: ``prompt_tokens_cached``). SGLang exposes a hit-rate gauge only: None there.
    prefix_cache_hits_total: float | None = None
    #: ``process_start_time_seconds`` (the Python process collector; vLLM's API server exposes
    #: it, SGLang's multiprocess registry and llama.cpp do not).
    process_start_time_seconds: float | None = None
    #: llama.cpp's ``Process-Start-Time-Unix`` response header, set by the scraper (the text
    #: does not carry it).
    start_time_header: float | None = None
    #: The earliest ``*_created`` sample: when the server's metrics came into existence. A
    #: fallback start time where ``process_start_time_seconds`` is missing.
    created_min: float | None = None
    #: Values of ``model_name``/``model`` labels seen on the server's own families; a change is
    #: evidence of a different model, hence a different instance.
    model_names: frozenset[str] = frozenset()
    #: Every sample, in page order.
    raw: tuple[RawSample, ...] = ()
    #: Family name (as the parser names it) to its TYPE.
    types: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def start_time(self) -> tuple[float, str] | tuple[None, None]:
        """The best start time the server gives away, and where it came from.

        Order of trust: the process collector's value, then llama.cpp's header, then the
        earliest ``_created`` timestamp (set when the counters were registered, i.e. at
        startup). Two snapshots are only compared on start time when the source matches.
        """
        if self.process_start_time_seconds is not None:
            return self.process_start_time_seconds, "process_start_time_seconds"
        if self.start_time_header is not None:
            return self.start_time_header, "Process-Start-Time-Unix"
        if self.created_min is not None:
            return self.created_min, "min(*_created)"
        return None, None

    @property
    def spec_exposed(self) -> bool:
        """Whether the page carries speculative-decoding *counters* (not SGLang's gauges)."""
        return self.spec_drafts_total is not None


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def _dedupe_replicas(rows: list[tuple[dict[str, str], float]]) -> list[tuple[dict[str, str], float]]:
    """Keep, for each replica label present, only the lowest rank (see ``_REPLICA_LABELS``)."""
    for label in _REPLICA_LABELS:
        ranks = [labels[label] for labels, _ in rows if label in labels]
        if not ranks:
            continue
        lowest = min(ranks, key=lambda r: (len(r), r))  # numeric order for digit strings
        rows = [(labels, v) for labels, v in rows if labels.get(label, lowest) == lowest]
    return rows


def parse_exposition(text: str) -> Snapshot:
    """Parse Prometheus text exposition into a ``Snapshot``.

    Raises ``ScrapeError`` when the text is not an exposition (an HTML error page, a JSON
    error body, a truncated line). An empty page is valid Prometheus and yields an empty
    ``unknown`` snapshot.

    Parsing is pure Python (prometheus_client's parser is most of the cost), so a vLLM page with
    its histograms takes milliseconds (docs/performance.md, "Design figures"):
    ``specproxy.observe.scrape.Scraper`` runs large pages in a thread.
    """
    if not isinstance(text, str):
        raise ScrapeError(f"exposition must be text, got {type(text).__name__}")
    raw: list[RawSample] = []
    types: dict[str, str] = {}
    # sample name -> [(labels, value)] for the families we may normalize
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    created: list[float] = []
    # imported here: the analysis reads this module's types, and only a scrape parses (50 ms of imports)
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for s in family.samples:
                value = float(s.value)
                raw.append(RawSample(s.name, tuple(sorted(s.labels.items())), value))
                if s.name.endswith("_created"):
                    if _finite(value):
                        created.append(value)
                    continue
                if family.type in _SKIP_TYPES:
                    continue
                by_name.setdefault(s.name, []).append((dict(s.labels), value))
    except ScrapeError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as e:
        first = text.lstrip()[:60].splitlines()[0] if text.strip() else ""
        raise ScrapeError(f"not a Prometheus text exposition ({e}); it starts with {first!r}") from e

    kind = _detect_kind(raw)
    sources = _FIELD_SOURCES.get(kind, {})

    def lookup(base: str) -> list[tuple[dict[str, str], float]] | None:
        for name in (base + "_total", base):
            rows = by_name.get(name)
            if rows is not None:
                return _dedupe_replicas(rows)
        return None

    def summed(key: str) -> float | None:
        base = sources.get(key)
        rows = lookup(base) if base else None
        if rows is None:
            return None
        values = [v for _, v in rows if _finite(v)]
        return float(sum(values)) if values else None

    def averaged(key: str) -> float | None:
        base = sources.get(key)
        rows = lookup(base) if base else None
        if rows is None:
            return None
        values = [v for _, v in rows if _finite(v)]
        return float(sum(values) / len(values)) if values else None

    per_pos: dict[int, float] | None = None
    if "spec_accepted_per_pos" in sources:
        rows = lookup(sources["spec_accepted_per_pos"])
        if rows is not None:
            acc: dict[int, float] = {}
            for labels, v in rows:
                try:
                    pos = int(labels.get("position", ""))
                except ValueError:
                    continue
                if _finite(v):
                    acc[pos] = acc.get(pos, 0.0) + v
            per_pos = dict(sorted(acc.items())) if acc else None

    start_rows = by_name.get("process_start_time_seconds")
    start_vals = [v for _, v in start_rows or () if _finite(v)]

    models: set[str] = set()
    if kind != "unknown":
        prefix = next(p for p, k in _PREFIXES.items() if k == kind)
        for name, rows in by_name.items():
            if name.startswith(prefix):
                for labels, _ in rows:
                    for label in _MODEL_LABELS:
                        if label in labels:
                            models.add(labels[label])

    hits = summed("prefix_cache_hits_total")
    queries = summed("prefix_cache_queries_total")
    if kind == "llamacpp" and hits is not None:
        processed = summed("prompt_tokens_total")
        queries = processed + hits if processed is not None else None
    return Snapshot(
        server_kind=kind,
        prefix_cache_queries_total=queries,
        prefix_cache_hits_total=hits,
        requests_running=summed("requests_running"),
        requests_waiting=summed("requests_waiting"),
        generation_tokens_total=summed("generation_tokens_total"),
        prompt_tokens_total=summed("prompt_tokens_total"),
        spec_drafts_total=summed("spec_drafts_total"),
        spec_draft_tokens_total=summed("spec_draft_tokens_total"),
        spec_accepted_tokens_total=summed("spec_accepted_tokens_total"),
        spec_accepted_per_pos=MappingProxyType(per_pos) if per_pos is not None else None,
        spec_accept_length=averaged("spec_accept_length"),
        spec_accept_rate=averaged("spec_accept_rate"),
        process_start_time_seconds=min(start_vals) if start_vals else None,
        created_min=min(created) if created else None,
        model_names=frozenset(models),
        raw=tuple(raw),
        types=MappingProxyType(types),
    )


def _detect_kind(raw: Sequence[RawSample]) -> ServerKind:
    """The server kind whose metric prefix the most samples carry (mlx-serve and other
    look-alikes that reuse ``vllm:`` names are read as vLLM, which is what they imitate)."""
    counts = {kind: 0 for kind in _PREFIXES.values()}
    for s in raw:
        for prefix, kind in _PREFIXES.items():
            if s.name.startswith(prefix):
                counts[kind] += 1
                break
    best = max(counts, key=lambda k: counts[k])
    return best if counts[best] else "unknown"
