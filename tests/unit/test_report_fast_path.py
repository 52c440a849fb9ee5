"""The report's fast path (figures by one partition, the server's counters on columns, turns from the
columnar cache) gives the very JSON of a plain reference over the same generated database: every
figure read off sorted values with numpy's own median and percentile, the server's counters as
``window_counters`` over a ScrapeSample per stored scrape, turns selected by SQL."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from specproxy.analyze import server_report, summary
from specproxy.analyze.arrays import clean
from specproxy.analyze.report_data import REPORT_COLUMNS, build_report
from specproxy.observe.counters import ScrapeSample, window_counters
from specproxy.observe.server_metrics import Snapshot
from specproxy.store.source import SCRAPE_FIELDS, Window
from specproxy.store.sqlite_source import SQLiteSource

ROOT = Path(__file__).resolve().parents[2]


def bench_report_module():
    spec = importlib.util.spec_from_file_location("bench_report_for_tests", ROOT / "scripts" / "bench_report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    gen = bench_report_module()
    gen.SPAN = 6 * 3600.0  # six hours of turns and of scrapes every 5 s (a week is 121k scrapes)
    path = tmp_path_factory.mktemp("fast") / "turns.db"
    gen.generate(path, 6000)
    return path


def plain_summarize(values, *, seed: int = 0, level: float = 0.95) -> summary.Summary:
    """Every figure read off one sorted copy; the mean in the values' order, as summarize sums it."""
    x = clean(values)
    summary.check_level(level)
    if not x.size:
        return summary.Summary(0, None, None, None, None, None)
    s, n = np.sort(x), x.size
    ranks = summary._median_ranks(n, level)
    lo = hi = None
    if ranks is not None:
        d, lam = ranks
        lo, hi = float(summary._between(s[d - 1], s[d], lam)), float(summary._between(s[n - d], s[n - d - 1], lam))
    return summary.Summary(n, float(np.median(s)), float(x.mean()), float(np.percentile(s, 95)), lo, hi)


def plain_counters(scrapes, idx):
    """A ScrapeSample for every successful scrape of the window, then window_counters."""
    samples = []
    for i in idx.tolist():
        fields = {f: (None if np.isnan(scrapes.num[f][i]) else float(scrapes.num[f][i])) for f in SCRAPE_FIELDS
                  if f != "latency_s"}  # the scrape's, not the page's
        t = float(scrapes.t_wall[i])
        samples.append(ScrapeSample(t, t, Snapshot(server_kind=scrapes.server_kind[i], **fields),
                                    scrapes.instance_id[i] or ""))
    return window_counters(samples, samples[0].t_mono, samples[-1].t_mono)


def report_json(path: Path, cache: bool, window: Window = Window()) -> bytes:
    with SQLiteSource(path, cache=cache) as store:
        data = store.load(window, REPORT_COLUMNS, server=True, context=True)
    return orjson.dumps(build_report(data, source="db"), option=orjson.OPT_SORT_KEYS)


@pytest.mark.parametrize("window", [Window(), Window(label="eagle3"),
                                    Window(since=1_790_000_000.0 + 3600, until=1_790_000_000.0 + 7200)])
def test_the_fast_report_equals_the_plain_reference(db, monkeypatch, window):
    fast = report_json(db, cache=True, window=window)
    summarize = summary.summarize
    patched = [name for name, mod in list(sys.modules.items())
               if name.startswith("specproxy.analyze") and getattr(mod, "summarize", None) is summarize]
    for name in patched:
        monkeypatch.setattr(sys.modules[name], "summarize", plain_summarize)
    assert {"specproxy.analyze.report_data", "specproxy.analyze.server_report"} <= set(patched)
    monkeypatch.setattr(server_report, "_counters", plain_counters)
    monkeypatch.setattr(server_report, "median_p95_max",  # numpy's own, each by its own partition
                        lambda x: (float(np.median(x)), float(np.percentile(x, 95)), float(np.max(x))))
    plain = report_json(db, cache=False, window=window)
    assert orjson.loads(plain)["server"]["window"]["seconds"] > 0  # the server section is there to compare
    assert fast == plain
