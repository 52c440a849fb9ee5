"""What happened between scrapes of a server's counters: deltas, windows, restarts (sans-I/O).

Why apart from parsing (``server_metrics``): a delta is where the meaning lives — MAL as
``1 + accepted/drafts``, acceptance rate, the server's generated and accepted-draft rates — and where
the traps are: a counter that goes down is a restart, and nothing may be derived across it; servers
that credit counters when a request finishes need windows that span whole requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from specproxy.observe.server_metrics import ServerKind, Snapshot

__all__ = ["COUNTER_FIELDS", "CounterDelta", "ScrapeSample", "delta", "restart_reason", "running_distribution",
           "stretch_counters", "window_counters"]



@dataclass(frozen=True)
class ScrapeSample:
    """One scrape, stamped when the response headers arrived.

    ``t_mono`` is the scraper's monotonic clock (seconds) and ``t_wall`` is ``time.time()`` at
    the same moment; the server built the page between sending the request and that moment,
    and ``latency_s`` (request sent to headers) bounds how stale the page can be.
    ``instance_id`` names the server process that produced it (``specproxy.observe.scrape.Instance``);
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
    ("prefix_cache_queries", "prefix_cache_queries_total"),
    ("prefix_cache_hits", "prefix_cache_hits_total"),
)

# the Snapshot fields that are counters (a counter that goes down is a restart: ``restart_reason``)
COUNTER_FIELDS = tuple(name for _, name in _COUNTER_FIELDS)

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
    #: Prompt tokens looked up in the server's prefix cache, and found there (``Snapshot``).
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
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
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache / looked up; ``None`` when none was looked up."""
        if self.prefix_cache_hits is None or not self.prefix_cache_queries:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

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
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
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
        # forward pass (docs/metrics.md: "1.00 where nothing drafts") -- unless nothing was
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
    return _counter_delta(seconds, b.server_kind, counts, per_pos, mal, source)


def _counter_delta(seconds: float, kind, counts: dict, per_pos: dict | None, mal: float | None,
                   source: str | None, *, segments: int = 1) -> CounterDelta:
    """A ``CounterDelta`` from summed counts: one place for one interval and for a window of segments."""
    return CounterDelta(
        seconds=seconds,
        server_kind=kind,
        generated_tokens=counts["generated_tokens"],
        prompt_tokens=counts["prompt_tokens"],
        drafts=counts["drafts"],
        draft_tokens=counts["draft_tokens"],
        accepted_tokens=counts["accepted_tokens"],
        prefix_cache_queries=counts["prefix_cache_queries"],
        prefix_cache_hits=counts["prefix_cache_hits"],
        accepted_per_pos=MappingProxyType(per_pos) if per_pos is not None else None,
        mal=mal,
        mal_source=source,
        segments=segments,
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
    stretches = [seg for seg in _segments(inside) if len(seg) >= 2]
    gauges = [s.snapshot.spec_accept_length for seg in stretches for s in seg
              if s.snapshot.spec_accept_length is not None and (s.snapshot.requests_running or 0) > 0]
    return stretch_counters([(seg[0], seg[-1]) for seg in stretches], gauges)


def stretch_counters(ends: Sequence[tuple[ScrapeSample, ScrapeSample]], gauges: Sequence[float]) -> CounterDelta | None:
    """The counters over restart-free stretches (``window_counters``' semantics), each given by its first
    and last sample only, with ``gauges``: the SGLang ``spec_accept_length`` values of the stretches'
    samples taken while something ran. Why apart: a report over a month of stored scrapes finds the
    stretches on columns (``analyze/server_report.py``) and builds samples for their ends alone, not
    half a million objects; both paths then count alike here."""
    deltas = [delta(a, b) for a, b in ends]
    if not deltas:
        return None
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
        if gauges:
            mal, source = _mal_from("sglang", None, None, None, False, sum(gauges) / len(gauges))
    elif kinds == {"vllm"} and all(d.drafts is None for d in deltas):
        mal, source = _mal_from("vllm", counts["generated_tokens"], None, None, False, None)
    elif any(d.mal is not None for d in deltas):
        # e.g. one instance with spec counters and one without: no single definition covers both
        source = "mixed"
    return _counter_delta(seconds, kind, counts, per_pos, mal, source, segments=len(deltas))


def running_distribution(
    samples: Sequence[ScrapeSample], t0: float | None = None, t1: float | None = None
) -> list[float]:
    """The server's ``requests_running`` at each scrape (optionally within ``[t0, t1]``), in
    time order, for the operating point (docs/metrics.md: quote its median and p95, never the
    configured maximum). Scrapes that did not expose it are left out, not read as 0."""
    chosen = sorted(
        (s for s in samples if (t0 is None or s.t_mono >= t0) and (t1 is None or s.t_mono <= t1)),
        key=lambda s: s.t_mono,
    )
    return [s.snapshot.requests_running for s in chosen if s.snapshot.requests_running is not None]
