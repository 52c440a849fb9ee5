"""/_specproxy/metrics across a fleet: each proxy's page is a target of its own and PromQL sums them
(``sum by (le) (...)``), so no family may carry a label that differs from one process to the next (the
proxy's name, the upstream's instance, a start time). Two proxies fed halves of the same turns must show
exactly the same series, whose sums are the page of one proxy fed them all; who each proxy is lives only
in ``specproxy_proxy_info``. Issue 35."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specproxy.measure.chunk_gaps import GAP_BOUNDS_S, StreamTiming
from specproxy.record import Record, new_turn_id
from specproxy.serve.own_metrics import OwnMetrics

INFO = "specproxy_proxy_info"


def turns() -> list[tuple[Record, StreamTiming | None]]:
    """Pairs of turns under the same labels (with different figures): one of each pair to each proxy."""
    out = []
    for j in range(80):
        i = j // 2
        streamed = i % 4 != 3
        api = ("chat", "completions", "messages", "responses")[i % 4]
        r = Record(id=new_turn_id(), t_wall=1.7e9 + j, method="POST", path="/v1/x", status=200,
                   outcome="ok" if i % 5 else "client_cancelled", streamed=streamed, model=("m1", "m2")[i // 20],
                   api=api, prompt_tokens=10 + i, completion_tokens=20 + j, total_s=0.5 + i / 100,
                   prompt_system_tokens=3, prompt_new_tokens=7 + i,
                   ttft_s=0.1 + j / 1000 if streamed else None, decode_s=0.4 if streamed else None,
                   decode_tps=30.0 + j if streamed else None, tokens_per_chunk=1.5 if streamed else None,
                   request_parsed=True, measured=True, instance_id=f"upstream-{j % 2}")
        counts = [0] * (len(GAP_BOUNDS_S) + 1)
        counts[i % 5] = 3
        timing = StreamTiming(0.05 + i / 1000, tuple(counts), 0.01 * i) if streamed else None
        out.append((r, timing))
    return out


def page(metrics: OwnMetrics) -> dict[tuple, float]:
    """Every sample but the info metric's: (name, labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name != INFO:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def proxy(name: str, instance: str, n: int) -> OwnMetrics:
    """A proxy named ``name`` whose sink's figures are ``n`` (and its multiples), in front of ``instance``."""
    return OwnMetrics(dict, lambda: {"postgresql://fleet@db/fleet": {
        "sink_rows_behind": n, "sink_seconds_behind": 0.0, "sink_rows_shipped": 2 * n,
        "sink_batches_failed": n, "sink_rows_set_aside": 3 * n}},
        lambda: {"proxy_name": name, "version": "0.1.0", "upstream_instance": instance})


def test_two_proxies_series_are_the_same_and_sum_to_one_fed_every_turn():
    a, b, both = proxy("edge-a", "upstream-0", 3), proxy("edge-b", "upstream-1", 4), proxy("all", "x", 7)
    for i, (r, timing) in enumerate(turns()):
        (a if i % 2 else b).record(r, timing)
        both.record(r, timing)
    pa, pb, pboth = page(a), page(b), page(both)
    # the same series on both proxies: nothing per process among the labels, so `sum by` merges them
    assert set(pa) == set(pb) == set(pboth)
    assert any(name.endswith("_bucket") for name, _ in pa) and any("sink" in dict(k) for _, k in pa)
    for key in pboth:  # counts exactly; sums of seconds up to the float rounding of adding in another order
        assert pa[key] + pb[key] == pytest.approx(pboth[key], rel=1e-12, abs=0), key


def test_who_the_proxy_is_is_in_the_info_metric_only():
    a = proxy("edge-a", "upstream-0", 1)
    r, timing = turns()[0]
    a.record(r, timing)
    families = {f.name: f for f in text_string_to_metric_families(a.exposition().decode())}
    (info,) = families[INFO].samples
    assert info.name == INFO and info.value == 1
    assert info.labels == {"proxy_name": "edge-a", "version": "0.1.0", "upstream_instance": "upstream-0"}
    for name, family in families.items():
        if name != INFO:
            for s in family.samples:
                assert not {"edge-a", "upstream-0"} & set(s.labels.values()), (name, s.labels)
