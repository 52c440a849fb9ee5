"""The report's "by proxy" and "by server instance" tables (issue 35): a row per proxy or instance, when
the turns come from more than one, with the same figures the whole report gives over that one's turns."""

from __future__ import annotations

import random

import pytest

from specproxy.analyze.report import render_text
from specproxy.app.cli_common import report_of
from specproxy.app.fake_upstream import make_record
from specproxy.store.writer import Writer

T0 = 1_800_000_000.0


def records(proxies, instances, n=90):
    rng = random.Random(3)
    return [make_record(seed=rng.random(), t_wall=T0 + i, proxy_name=proxies[i % len(proxies)],
                        instance_id=instances[i % len(instances)], label=f"L{i % 2}",
                        outcome="ok" if i % 10 else "client_abort") for i in range(n)]


def write(path, proxies, instances, n=90, keep=lambda r: True):
    w = Writer(path)
    for r in records(proxies, instances, n):
        if keep(r):
            w.put(r)
    w.close()
    return str(path)


def test_one_proxy_and_one_instance_give_no_table(tmp_path):
    r = report_of(write(tmp_path / "a.db", ["edge-1"], ["i1"]), cache=False)
    assert r["by_proxy"] == [] and r["by_instance"] == []
    assert "By proxy" not in render_text(r) and "By server instance" not in render_text(r)


@pytest.mark.parametrize("cache", [False, True])
def test_a_row_per_proxy_and_instance_with_that_ones_figures(tmp_path, cache):
    db = write(tmp_path / "a.db", ["edge-2", "edge-1", None], ["i1", "i2"])
    r = report_of(db, cache=cache)
    assert [row["proxy"] for row in r["by_proxy"]] == ["edge-1", "edge-2", None]  # by name; no name last
    assert [row["instance"] for row in r["by_instance"]] == ["i1", "i2"]
    assert sum(row["turns"] for row in r["by_proxy"]) == r["completed_turns"]["streamed"] == 81
    # a proxy's row is what the report says over that proxy's turns alone
    alone = report_of(write(tmp_path / "b.db", ["edge-2", "edge-1", None], ["i1", "i2"],
                            keep=lambda rec: rec.proxy_name == "edge-1"), cache=cache)
    row = r["by_proxy"][0]
    assert alone["by_proxy"] == [] and row["turns"] == alone["completed_turns"]["streamed"] == 27
    assert row["per_stream_tps"] == alone["user"]["decode_tps"] and row["ttft_s"] == alone["user"]["ttft_s"]
    assert row["aggregate"] == alone["by_concurrency"][0]["aggregate"]  # every turn alone: one cell
    text = render_text(r)
    assert "By proxy" in text and "By server instance" in text and "edge-1" in text
