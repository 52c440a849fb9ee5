"""``specproxy bench --phase prefill|decode`` against the real llama.cpp server of the test tier.

The fake upstream ignores ``max_tokens``; llama-server honours it and ``ignore_eos``, so here the probes
are checked against a server that does what they ask: a prefill probe's turns carry exactly one output
token, with a prefill speed and a prompt that grows with the length asked for, and no decode figure; a
decode probe's turns run to ``--max-tokens`` (the tiny model would end its turn long before) and give a
per-stream decode speed. Small prompts and few turns: the point is what is sent and stored, not speed.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
SPECPROXY = [sys.executable, "-m", "specproxy.app.cli"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECPROXY, "bench", *args], capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_probes_of_both_phases_against_llama_server(llama_server, hf_tokenizer_dir, tmp_path):
    db = tmp_path / "probes.db"
    common = ("--upstream", llama_server.url, "--db", str(db), "--tokenizer", f"hf:{hf_tokenizer_dir}",
              "--repeats", "2", "--json")
    proc = bench("--phase", "prefill", "--prompt-lengths", "20,120", *common)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr  # the server sent the one token asked for
    summary = json.loads(proc.stdout)
    assert summary["labels"] == ["bench-prefill"] and summary["warnings"] == []
    short, long = summary["arms"][0]["levels"]
    for lv in (short, long):
        assert lv["ok"] == lv["turns"] == 2, lv["errors"]
        assert "decode_tps" not in lv and "aggregate_tps" not in lv
        assert lv["prefill_tps"]["median"] > 0 and lv["ttft_s"]["median"] > 0
    assert long["prompt_tokens"]["median"] > short["prompt_tokens"]["median"] + 90  # 100 more words asked for

    # 96 tokens (~0.35 s at this model's ~270 tok/s): a decode speed needs its text in more than one read.
    # With 24 (~90 ms) a run on a loaded machine once got none for both turns, which a reader stalled
    # through the whole answer (one read) would give
    proc = bench("--phase", "decode", "--max-tokens", "96", *common)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    (lv,) = summary["arms"][0]["levels"]
    assert summary["labels"] == ["bench-decode"] and lv["ok"] == lv["turns"] == 2
    assert lv["decode_tps"]["median"] > 0

    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT label, completion_tokens, usage_completion_tokens FROM turns ORDER BY t_request").fetchall()
    conn.close()
    # the warm-up requests are not turns: 2 repeats x 2 lengths, then 2 decode turns
    assert [r[0] for r in rows] == ["bench-prefill"] * 4 + ["bench-decode"] * 2
    assert all(r[1] == r[2] == 1 for r in rows[:4]), rows  # prefill: one token, counted and as the server says
    assert all(r[1] == r[2] == 96 for r in rows[4:]), rows  # decode: ignore_eos held it to --max-tokens
