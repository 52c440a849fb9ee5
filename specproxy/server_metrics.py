"""What an inference server's own Prometheus counters say, as plain data (sans-I/O).

Why this module exists: a server's throughput figure and the tokens a user receives are
different quantities (the field note: 40.7 tok/s in the server log, 29.4 from the accepted
counter, 27.8 delivered). specproxy measures the delivered side itself; this module reads the
*server's* side so the two can be put next to each other and the mean acceptance length (MAL)
can be taken from the server's counters, as METRICS.md asks. Everything here is pure: text in,
frozen values out. The I/O (polling, instance identity) lives in ``specproxy.scrape``.

The pieces, top to bottom:

- ``parse_exposition(text) -> Snapshot``: the Prometheus text format, parsed with
  ``prometheus_client``'s own parser (never substrings), normalized per server kind.
- ``delta(before, after) -> CounterDelta``: what happened between two scrapes, with MAL,
  acceptance rate and rates; a counter that went down means a restart, and then nothing is
  derived across it.
- ``window_counters(samples, t0, t1)`` and ``running_distribution(samples)``: windows over a
  series of ``ScrapeSample`` values, split at restarts.

What each server's counters count (read in the servers' sources, see the notes on each field of
``Snapshot`` and ``CounterDelta``) differs, and the differences matter for reading them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from specproxy.errors import UpstreamError

__all__ = [
    "CounterDelta",
    "RawSample",
    "ScrapeError",
    "ScrapeSample",
    "ServerKind",
    "Snapshot",
    "delta",
    "parse_exposition",
    "running_distribution",
    "window_counters",
]

ServerKind = Literal["vllm", "llamacpp", "sglang", "unknown"]


class ScrapeError(UpstreamError):
    """The one error this module (and ``specproxy.scrape``) raises: the text is not a Prometheus
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

    Parsing is pure Python (prometheus_client's parser is ~90% of the cost) at ~16 us per
    sample line, so a vLLM page with its histograms takes several milliseconds:
    ``specproxy.scrape.Scraper`` runs large pages in a thread.
    """
    if not isinstance(text, str):
        raise ScrapeError(f"exposition must be text, got {type(text).__name__}")
    raw: list[RawSample] = []
    types: dict[str, str] = {}
    # sample name -> [(labels, value)] for the families we may normalize
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    created: list[float] = []
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

    return Snapshot(
        server_kind=kind,
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


# --------------------------------------------------------------------------------------------
# Samples over time, and what happened between two of them
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScrapeSample:
    """One scrape, stamped when the response headers arrived.

    ``t_mono`` is the scraper's monotonic clock (seconds) and ``t_wall`` is ``time.time()`` at
    the same moment; the server built the page between sending the request and that moment,
    and ``latency_s`` (request sent to headers) bounds how stale the page can be.
    ``instance_id`` names the server process that produced it (``specproxy.scrape.Instance``);
    ``restart`` is true on the first sample of a new instance seen by a running scraper.
    """

    t_mono: float
    t_wall: float
    snapshot: Snapshot
    instance_id: str
    restart: bool = False
    latency_s: float | None = None


_COUNTER_FIELDS = (
    ("generated_tokens", "generation_tokens_total"),
    ("prompt_tokens", "prompt_tokens_total"),
    ("drafts", "spec_drafts_total"),
    ("draft_tokens", "spec_draft_tokens_total"),
    ("accepted_tokens", "spec_accepted_tokens_total"),
)

MalSource = Literal["counters", "gauge", "no_spec_counters", "mixed"]


@dataclass(frozen=True)
class CounterDelta:
    """What a server's counters say happened between two scrapes (or over a window).

    Counts are ``None`` when either end did not expose the counter. When ``restarted`` is true
    a counter went down (or the start time changed) between the two ends: the server restarted
    and every count and derived value is ``None``, because nothing is known across a restart.

    What ``generated_tokens`` counts, per server (read in each server's source):

    - **vLLM (V1)**: ``vllm:generation_tokens`` is incremented every engine step by
      ``len(output.new_token_ids)`` (``IterationStats.update_from_output`` in
      ``vllm/v1/metrics/stats.py``), the tokens appended to each request after rejection
      sampling: accepted draft tokens plus the one token the target model produces per pass.
      So it counts *emitted* tokens, live, as they are produced; rejected drafts are not in it.
    - **llama.cpp**: ``llamacpp:tokens_predicted_total`` is the sum of each slot's ``n_gen``,
      incremented once per token handed to ``process_token`` (the accepted drafts and the
      sampled token of each verification, ``post_decode`` in ``tools/server/server-context.cpp``),
      so it also counts *emitted* tokens; but it is credited to the server total when the
      request *finishes* (``metrics.on_prediction(slot)`` next to ``slot.release()`` in the
      builds read; flushed per slot at completion after the 2026 metrics refactor), as are the
      spec-decode counters. A window shorter than a request sees nothing, then a burst; use windows that
      span whole requests, or many of them.
    - **SGLang**: ``sglang:generation_tokens_total`` is incremented once per finished request
      by its ``completion_tokens`` (``TokenizerMetricsCollector.observe_one_finished_request``):
      *emitted* tokens, credited at the finish, like llama.cpp.

    None of them counts rejected draft tokens here; the number that does include the trash is a
    rate of *drafted* tokens (vLLM's log "Drafted throughput"), or a throughput line measured at
    its peak over a few seconds. ``accepted_tokens`` is the *accepted draft* count only: vLLM's
    log line "Accepted throughput" is ``accepted_tps`` below, and it leaves out the token each
    verification pass produces itself, so it is always below what users receive. What users
    receive is specproxy's own ``completion_tokens``; ``generated_tps`` is the server's view of
    the same thing.
    """

    #: Seconds between the two ends (``None`` when the ends carried no time).
    seconds: float | None
    server_kind: ServerKind
    generated_tokens: float | None = None
    prompt_tokens: float | None = None
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accepted_per_pos: Mapping[int, float] | None = None
    #: Mean acceptance length: tokens emitted per target-model verification pass.
    mal: float | None = None
    #: Where ``mal`` came from: ``counters`` (``1 + accepted/drafts``, exactly 1.0 when the
    #: server exposes spec counters, tokens were generated and nothing drafted), ``gauge``
    #: (SGLang's ``spec_accept_length``, not window-exact), ``no_spec_counters`` (vLLM registers
    #: its spec counters only when a speculative config is loaded, so their absence means
    #: nothing drafts: 1.0), ``mixed`` (a window over instances that disagree: ``None``).
    mal_source: MalSource | None = None
    restarted: bool = False
    #: Instances (restart-free stretches) summed into this delta; 1 for ``delta()``.
    segments: int = 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / proposed draft tokens; ``None`` when nothing was proposed."""
        if self.accepted_tokens is None or not self.draft_tokens:
            return None
        return self.accepted_tokens / self.draft_tokens

    @property
    def generated_tps(self) -> float | None:
        """The server's generation counter per second (emitted tokens on all three servers;
        see the class docstring for when each server credits them)."""
        return _rate(self.generated_tokens, self.seconds)

    @property
    def accepted_tps(self) -> float | None:
        """Accepted *draft* tokens per second: vLLM's "Accepted throughput". Not delivered
        tokens: it omits the one token per verification pass the target model produces."""
        return _rate(self.accepted_tokens, self.seconds)

    @property
    def spec_emitted_tokens(self) -> float | None:
        """Tokens emitted by verification passes: accepted drafts + one per pass. Compare with
        ``generated_tokens``: the difference is tokens from passes without a draft."""
        if self.accepted_tokens is None or self.drafts is None:
            return None
        return self.accepted_tokens + self.drafts

    def to_dict(self) -> dict[str, object]:
        """Plain values, derived ones included, for storage and reports."""
        return {
            "seconds": self.seconds,
            "server_kind": self.server_kind,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_pos": dict(self.accepted_per_pos) if self.accepted_per_pos else None,
            "mal": self.mal,
            "mal_source": self.mal_source,
            "acceptance_rate": self.acceptance_rate,
            "generated_tps": self.generated_tps,
            "accepted_tps": self.accepted_tps,
            "restarted": self.restarted,
            "segments": self.segments,
        }


def _rate(count: float | None, seconds: float | None) -> float | None:
    if count is None or not seconds or seconds <= 0:
        return None
    return count / seconds


def _counters_went_down(a: Snapshot, b: Snapshot) -> bool:
    for _, name in _COUNTER_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is not None and y is not None and y < x:
            return True
    if a.spec_accepted_per_pos and b.spec_accepted_per_pos:
        for pos, x in a.spec_accepted_per_pos.items():
            y = b.spec_accepted_per_pos.get(pos)
            if y is not None and y < x:
                return True
    return False


def restart_reason(a: Snapshot, b: Snapshot) -> str | None:
    """Why ``b`` cannot come from the same server process as ``a``, or ``None``.

    Evidence, strongest first: a different server kind, a different start time from the same
    source (half a second of slack for sources printed as whole seconds), a counter that went
    down. A counter cannot go down in a live process; a restart starts it again from zero.
    """
    if a.server_kind != b.server_kind:
        return f"server kind changed ({a.server_kind} -> {b.server_kind})"
    (ta, sa), (tb, sb) = a.start_time, b.start_time
    if ta is not None and tb is not None and sa == sb and abs(ta - tb) > 0.5:
        return f"start time changed ({sa}: {ta} -> {tb})"
    if _counters_went_down(a, b):
        return "a counter went down"
    return None


def _mal_from(
    kind: ServerKind,
    generated: float | None,
    drafts: float | None,
    accepted: float | None,
    spec_exposed: bool,
    gauge: float | None,
) -> tuple[float | None, MalSource | None]:
    if spec_exposed:
        if drafts is None or accepted is None:
            return None, None
        if drafts > 0:
            return 1.0 + accepted / drafts, "counters"
        # Spec counters exist but nothing drafted: every emitted token came from a plain
        # forward pass (METRICS.md: "1.00 where nothing drafts") -- unless nothing was
        # generated at all, in which case there were no passes to average over.
        if generated is not None and generated == 0:
            return None, None
        return 1.0, "counters"
    if gauge is not None:
        # SGLang: 0 is its value when no speculative algorithm runs; an accept length is >= 1.
        return (gauge, "gauge") if gauge >= 1.0 else (1.0, "gauge")
    if kind == "vllm":
        if generated is not None and generated == 0:
            return None, None
        return 1.0, "no_spec_counters"
    return None, None  # llama.cpp builds before the spec counters, unknown servers: unknown


def _times(x: ScrapeSample | Snapshot) -> tuple[Snapshot, float | None]:
    if isinstance(x, ScrapeSample):
        return x.snapshot, x.t_mono
    return x, None


def delta(
    before: ScrapeSample | Snapshot,
    after: ScrapeSample | Snapshot,
    seconds: float | None = None,
) -> CounterDelta:
    """What the counters say happened from ``before`` to ``after``.

    Pass two ``ScrapeSample`` values (the seconds come from their monotonic stamps) or two
    ``Snapshot`` values and, if rates are wanted, ``seconds``. Across a restart (see
    ``restart_reason``) the result has ``restarted=True`` and no counts: a delta across a
    restart would be the new process's total minus the old one's, which means nothing.
    """
    a, t0 = _times(before)
    b, t1 = _times(after)
    if seconds is None and t0 is not None and t1 is not None:
        seconds = t1 - t0
    if restart_reason(a, b) is not None:
        return CounterDelta(seconds=seconds, server_kind=b.server_kind, restarted=True)
    counts: dict[str, float | None] = {}
    for out, name in _COUNTER_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        counts[out] = (y - x) if x is not None and y is not None else None
    per_pos: dict[int, float] | None = None
    if a.spec_accepted_per_pos is not None and b.spec_accepted_per_pos is not None:
        per_pos = {p: y - a.spec_accepted_per_pos.get(p, 0.0) for p, y in b.spec_accepted_per_pos.items()}
    elif b.spec_accepted_per_pos is not None and a.spec_exposed:
        # llama.cpp prints the per-position family only once a speculative request finished:
        # absent before means all zero before.
        per_pos = dict(b.spec_accepted_per_pos)
    # SGLang's gauge keeps its last value while idle: only trust it when something ran.
    active = (b.requests_running or 0) > 0 or (counts["generated_tokens"] or 0) > 0
    mal, source = _mal_from(
        b.server_kind,
        counts["generated_tokens"],
        counts["drafts"],
        counts["accepted_tokens"],
        a.spec_exposed and b.spec_exposed,
        b.spec_accept_length if active else None,
    )
    return CounterDelta(
        seconds=seconds,
        server_kind=b.server_kind,
        generated_tokens=counts["generated_tokens"],
        prompt_tokens=counts["prompt_tokens"],
        drafts=counts["drafts"],
        draft_tokens=counts["draft_tokens"],
        accepted_tokens=counts["accepted_tokens"],
        accepted_per_pos=MappingProxyType(per_pos) if per_pos is not None else None,
        mal=mal,
        mal_source=source,
    )


def _sum_opt(values: Iterable[float | None]) -> float | None:
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def _segments(samples: Sequence[ScrapeSample]) -> list[list[ScrapeSample]]:
    """Split time-ordered samples into restart-free stretches: a new stretch starts where the
    instance id changes or where the counters themselves show a restart."""
    out: list[list[ScrapeSample]] = []
    for s in samples:
        if out:
            last = out[-1][-1]
            if s.instance_id == last.instance_id and restart_reason(last.snapshot, s.snapshot) is None:
                out[-1].append(s)
                continue
        out.append([s])
    return out


def window_counters(samples: Sequence[ScrapeSample], t0: float, t1: float) -> CounterDelta | None:
    """The counters' account of the window ``[t0, t1]`` (monotonic seconds), interpolation-free.

    Semantics, chosen so every number is something a server actually printed:

    - Only samples with ``t0 <= t_mono <= t1`` are used. Within each restart-free stretch the
      delta runs from its first such sample to its last; nothing is interpolated to the window
      edges, so the covered time (``seconds``) can be shorter than ``t1 - t0`` by up to one
      scrape interval at each end, and rates use the covered time.
    - Restarts split the window (a change of ``instance_id``, or counters that went down); the
      result sums the stretches' counts and seconds, with ``segments`` saying how many. What
      happened between the last scrape of an instance and its death is lost, and said so by
      ``segments > 1``. A count is ``None`` if any stretch lacks it.
    - Because the stretches share their boundary samples with neighbouring windows, windows
      that meet at a sample add up exactly.
    - MAL comes from the summed counters. For SGLang (gauge only) it is the mean of the
      ``spec_accept_length`` gauge over samples taken while something was running (an idle
      server keeps showing its last value), which is an approximation and labelled ``gauge``.

    Returns ``None`` when no stretch holds two samples in the window.
    """
    inside = sorted((s for s in samples if t0 <= s.t_mono <= t1), key=lambda s: s.t_mono)
    parts: list[tuple[CounterDelta, list[ScrapeSample]]] = []
    for seg in _segments(inside):
        if len(seg) >= 2:
            parts.append((delta(seg[0], seg[-1]), seg))
    if not parts:
        return None
    deltas = [d for d, _ in parts]
    kinds = {d.server_kind for d in deltas}
    kind: ServerKind = deltas[-1].server_kind if len(kinds) == 1 else "unknown"
    counts = {out: _sum_opt(getattr(d, out) for d in deltas) for out, _ in _COUNTER_FIELDS}
    seconds = _sum_opt(d.seconds for d in deltas)

    per_pos: dict[int, float] | None = None
    if all(d.accepted_per_pos is not None for d in deltas):
        per_pos = {}
        for d in deltas:
            assert d.accepted_per_pos is not None
            for p, v in d.accepted_per_pos.items():
                per_pos[p] = per_pos.get(p, 0.0) + v

    mal: float | None = None
    source: MalSource | None = None
    if all(d.drafts is not None for d in deltas):
        mal, source = _mal_from(
            kind, counts["generated_tokens"], counts["drafts"], counts["accepted_tokens"], True, None
        )
    elif kinds == {"sglang"}:
        gauges = [
            s.snapshot.spec_accept_length
            for _, seg in parts
            for s in seg
            if s.snapshot.spec_accept_length is not None and (s.snapshot.requests_running or 0) > 0
        ]
        if gauges:
            mal, source = _mal_from("sglang", None, None, None, False, sum(gauges) / len(gauges))
    elif kinds == {"vllm"} and all(d.drafts is None for d in deltas):
        mal, source = _mal_from("vllm", counts["generated_tokens"], None, None, False, None)
    elif any(d.mal is not None for d in deltas):
        # e.g. one instance with spec counters and one without: no single definition covers both
        source = "mixed"
    return CounterDelta(
        seconds=seconds,
        server_kind=kind,
        generated_tokens=counts["generated_tokens"],
        prompt_tokens=counts["prompt_tokens"],
        drafts=counts["drafts"],
        draft_tokens=counts["draft_tokens"],
        accepted_tokens=counts["accepted_tokens"],
        accepted_per_pos=MappingProxyType(per_pos) if per_pos is not None else None,
        mal=mal,
        mal_source=source,
        segments=len(deltas),
    )


def running_distribution(
    samples: Sequence[ScrapeSample], t0: float | None = None, t1: float | None = None
) -> list[float]:
    """The server's ``requests_running`` at each scrape (optionally within ``[t0, t1]``), in
    time order, for the operating point (METRICS.md: quote its median and p95, never the
    configured maximum). Scrapes that did not expose it are left out, not read as 0."""
    chosen = sorted(
        (s for s in samples if (t0 is None or s.t_mono >= t0) and (t1 is None or s.t_mono <= t1)),
        key=lambda s: s.t_mono,
    )
    return [s.snapshot.requests_running for s in chosen if s.snapshot.requests_running is not None]
