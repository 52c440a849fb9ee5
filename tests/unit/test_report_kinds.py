"""Streamed and non-streamed turns are two populations in ``specproxy report``.

A non-streamed reply arrives whole: its "TTFT" is the whole response time, it has no decode time or
speed, and it is one chunk of all its tokens. Mixed into the stream figures, 8 streamed turns (TTFT
~0.05 s, 2 tokens per chunk) and 8 non-streamed ones (~0.27 s, one 46-token chunk) gave a TTFT median
of ~0.16 s and tokens per chunk 24 that no turn had.
"""

from __future__ import annotations

import numpy as np
import pytest

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store.dataset import load_turns
from specproxy.analyze.report_data import build_report
from specproxy.analyze.report import render_text
from specproxy.store.db import open_store
from specproxy.store.writer import Writer
from specproxy.app.fake_upstream import make_record, make_whole_record

T0 = 1_700_000_000.0
TOKENS = 46


def write_mixed(path, *, streamed: int = 8, whole: int = 8) -> dict[str, list[float]]:
    """``streamed`` streamed turns then ``whole`` non-streamed ones, each alone, one second apart, with
    the server's scrapes around them and a counter delta (MAL 2) per turn; returns their true values."""
    rng = np.random.default_rng(7)
    truth: dict[str, list[float]] = {"ttft": [], "total": [], "whole": []}
    w = Writer(path)
    ids, t = [], T0
    for _ in range(streamed):
        ttft, decode = 0.05 * float(np.exp(rng.normal(0, 0.1))), 0.22 * float(np.exp(rng.normal(0, 0.1)))
        rec = make_record(t_wall=t, instance_id="inst-1", ttft_s=ttft, decode_s=decode, completion_tokens=TOKENS,
                          chunks=TOKENS // 2, tokens_per_chunk=2.0, first_chunk_tokens=2, content_class="prose")
        truth["ttft"].append(ttft)
        truth["total"].append(rec.total_s)
        ids.append(rec.id)
        w.put(rec)
        t += 1.0
    for _ in range(whole):
        total = 0.27 * float(np.exp(rng.normal(0, 0.1)))
        rec = make_whole_record(t_wall=t, instance_id="inst-1", total_s=total, completion_tokens=TOKENS,
                                content_class="prose")
        truth["whole"].append(total)
        ids.append(rec.id)
        w.put(rec)
        t += 1.0
    w.close()
    conn = open_store(path)
    for i, when in enumerate((T0 - 1.0, t + 1.0)):
        conn.execute("INSERT INTO scrapes (t_wall, t_mono, instance_id, server_kind, generation_tokens_total) "
                     "VALUES (?, ?, 'inst-1', 'vllm', ?)", (when, when, float(i * TOKENS * len(ids))))
    conn.executemany("INSERT INTO turn_counters (turn_id, instance_id, mal) VALUES (?, 'inst-1', 2.0)",
                     [(i,) for i in ids])
    conn.commit()
    conn.close()
    return truth


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("kinds") / "mixed.db"
    truth = write_mixed(path)
    conn = open_store(path)
    r = build_report(SQLiteSource(conn).load(server=True, context=True), source="mixed")
    conn.close()
    return r, truth


def test_stream_figures_are_over_streamed_turns_only(mixed):
    r, truth = mixed
    u = r["user"]
    assert u["ttft_s"]["median"] == pytest.approx(np.median(truth["ttft"])) and u["ttft_s"]["n"] == 8
    assert u["total_s"]["median"] == pytest.approx(np.median(truth["total"])) and u["total_s"]["n"] == 8
    assert u["tokens_per_chunk"]["median"] == 2.0 and u["tokens_per_chunk"]["p95"] == 2.0
    assert u["decode_s"]["n"] == 8 and u["decode_s"]["median"] > 0.1  # no non-streamed 0 s "decode"
    assert u["completion_tokens"]["n"] == 8
    assert r["completed_turns"] == {"streamed": 8, "non_streamed": 8}


def test_non_streamed_turns_have_their_own_figures(mixed):
    r, truth = mixed
    ns = r["non_streamed"]
    assert ns["total_s"]["n"] == 8 and ns["total_s"]["median"] == pytest.approx(np.median(truth["whole"]))
    assert ns["total_s"]["ci_low"] is not None and ns["total_s"]["p95"] is not None
    assert ns["completion_tokens"]["median"] == TOKENS
    text = render_text(r)
    assert "What users got (8 streamed turns that completed" in text
    assert "Non-streamed turns (8 that completed" in text
    whole_line = next(line for line in text.splitlines() if line.strip().startswith("whole response (s)"))
    assert whole_line.split()[3] == "8" and whole_line.split()[4] == f"{np.median(truth['whole']):.3f}"


def test_tables_split_the_kinds(mixed):
    r, truth = mixed
    (cls,) = r["by_content_class"]
    assert cls["tokens_per_chunk"]["median"] == 2.0 and cls["tokens_per_chunk"]["p95"] == 2.0 and cls["n"] == 8
    (conc,) = r["by_concurrency"]
    assert conc["ttft_s"]["median"] == pytest.approx(np.median(truth["ttft"])) and conc["n"] == 8
    assert conc["aggregate"]["n"] == 16  # delivered tokens over busy time: both kinds count
    assert conc["aggregate"]["tokens"] == 16 * TOKENS
    (plen,) = r["by_prompt_length"]
    assert plen["n"] == 8 and plen["ttft_s"]["median"] == pytest.approx(np.median(truth["ttft"]))
    assert "n all" in render_text(r)


def test_the_per_turn_mal_join_is_over_streamed_turns(mixed):
    r, _ = mixed
    lone = r["server"]["lone_turns"]
    assert lone["tokens_per_chunk"]["median"] == 2.0 and lone["mal"]["median"] == 2.0
    assert (lone["joined"], lone["alone"]) == (8, 8)
    assert "streamed turns that ran alone joined with their own counter deltas: 8 of 8" in render_text(r)


def test_an_all_streamed_report_has_no_non_streamed_section(tmp_path):
    path = tmp_path / "streamed.db"
    write_mixed(path, streamed=6, whole=0)
    conn = open_store(path)
    r = build_report(SQLiteSource(conn).load(server=True, context=True), source="s")
    conn.close()
    assert r["completed_turns"] == {"streamed": 6, "non_streamed": 0} and r["non_streamed"]["total_s"]["n"] == 0
    text = render_text(r)
    assert "Non-streamed" not in text and "n all" not in text
