"""The report's server section counts a window's stored scrapes on columns (restart-free stretches found
without a sample object per scrape, since a month is half a million scrapes); it must say exactly what
``window_counters`` says over the same scrapes as ScrapeSamples, restarts, changed kinds, counters that
went down, unexposed counters and failed scrapes included."""

from __future__ import annotations

import numpy as np
import pytest

from specproxy.analyze.server_report import server_section
from specproxy.observe.counters import ScrapeSample, running_distribution, window_counters
from specproxy.observe.server_metrics import Snapshot
from specproxy.store.dataset import Turns
from specproxy.store.source import SCRAPE_FIELDS, LoneJoins, Scrapes

T0 = 1_800_000_000.0


def random_scrapes(seed: int, n: int = 240) -> Scrapes:
    rng = np.random.default_rng(seed)
    kinds = ["llamacpp", "sglang", "vllm"]
    kind, inst, gen, k = rng.choice(kinds), "a", 0.0, 0
    t, ids, ks, errs = [], [], [], []
    num = {f: [] for f in SCRAPE_FIELDS}
    for i in range(n):
        r = rng.random()
        if r < 0.02:
            kind = rng.choice(kinds)
        elif r < 0.04:
            k += 1
            inst = "abc"[k % 3] if rng.random() < 0.7 else None
        elif r < 0.07:
            gen = 0.0  # a restart the counters show
        gen += float(rng.integers(0, 500))
        failed = rng.random() < 0.05
        t.append(T0 + 5.0 * i)
        ids.append(inst)
        ks.append(None if failed and rng.random() < 0.5 else kind)
        errs.append("timeout" if failed else None)
        spec = kind != "sglang" and rng.random() < 0.9
        values = {
            "requests_running": float(rng.integers(0, 4)) if rng.random() < 0.9 else np.nan,
            "requests_waiting": 0.0,
            "generation_tokens_total": gen if rng.random() < 0.97 else np.nan,
            "prompt_tokens_total": 3 * gen,
            "spec_drafts_total": gen / 2.5 if spec else np.nan,
            "spec_draft_tokens_total": gen / 1.2 if spec else np.nan,
            "spec_accepted_tokens_total": gen * 0.5 if spec else np.nan,
            "spec_accept_length": float(rng.uniform(1, 3)) if kind == "sglang" else np.nan,
            "spec_accept_rate": np.nan,
            "prefix_cache_queries_total": 3 * gen if kind != "sglang" and rng.random() < 0.95 else np.nan,
            "prefix_cache_hits_total": gen if kind != "sglang" and rng.random() < 0.95 else np.nan,
            "latency_s": np.nan if failed else float(rng.uniform(0.001, 0.05)),
        }
        for f in SCRAPE_FIELDS:
            num[f].append(values[f])
    obj = lambda v: np.array(v, dtype=object)  # noqa: E731
    return Scrapes(np.array(t), obj(ids), obj(ks), obj(errs), {f: np.array(v, dtype=float) for f, v in num.items()})


def reference(scrapes: Scrapes, w0: float, w1: float):
    """The plain way: every successful scrape of the window as a ScrapeSample, then window_counters."""
    samples = []
    for i in range(len(scrapes)):
        if scrapes.error[i] is not None or scrapes.server_kind[i] is None or not w0 <= scrapes.t_wall[i] <= w1:
            continue
        fields = {f: (None if np.isnan(scrapes.num[f][i]) else float(scrapes.num[f][i])) for f in SCRAPE_FIELDS
                  if f != "latency_s"}  # the scrape's, not the page's
        t = float(scrapes.t_wall[i])
        samples.append(ScrapeSample(t, t, Snapshot(server_kind=scrapes.server_kind[i], **fields),
                                    scrapes.instance_id[i] or ""))
    return samples, window_counters(samples, samples[0].t_mono, samples[-1].t_mono)


def turns_over(t_from: float, t_to: float) -> Turns:
    start = np.linspace(t_from, t_to - 10.0, 50)
    n = len(start)
    return Turns({"t_wall": start, "total_s": np.full(n, 10.0), "concurrency": np.full(n, 2.0),
                  "streamed": np.ones(n), "decode_tps": np.full(n, 40.0), "completion_tokens": np.full(n, 100.0),
                  "tokens_per_chunk": np.ones(n), "rowid": np.arange(n, dtype=np.int64)},
                 {"instance_id": np.array(["a"] * n, dtype=object)})


@pytest.mark.parametrize("seed", range(60))
def test_the_columnar_server_counters_equal_window_counters_over_samples(seed):
    scrapes = random_scrapes(seed)
    turns = turns_over(T0 + 3.0, T0 + 5.0 * 238)
    out = server_section(scrapes, LoneJoins(), turns)
    w = out.get("window")
    samples, d = reference(scrapes, out["span"]["first_scrape"], out["span"]["last_scrape"])
    assert out["scrapes"] == len(samples)
    assert out["instances"] == sorted({s.instance_id for s in samples if s.instance_id})
    assert out["server_kind"] == samples[-1].snapshot.server_kind
    if d is None or not d.seconds:
        assert w is None
        return
    for key, ref in (("seconds", d.seconds), ("segments", d.segments), ("generated_tokens", d.generated_tokens),
                     ("mal", d.mal), ("mal_source", d.mal_source), ("drafts", d.drafts),
                     ("accepted_tokens", d.accepted_tokens), ("draft_tokens", d.draft_tokens),
                     ("acceptance_rate", d.acceptance_rate)):
        assert w[key] == ref, (seed, key)
    running = running_distribution(samples)
    assert out["requests_running"]["max"] == (max(running) if running else None)


def test_a_restart_the_counters_show_splits_the_window():
    """Not a vacuous comparison: the generated scrapes do hold several stretches."""
    segments = [server_section(random_scrapes(s), LoneJoins(), turns_over(T0 + 3.0, T0 + 5.0 * 238))
                .get("window", {}).get("segments", 0) for s in range(20)]
    assert max(segments) >= 3
