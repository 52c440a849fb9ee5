"""How much CPU one live-page picture takes over a busy window, and so how often the page can update.

    python scripts/bench_page.py                 # 100,000 turns in the last 15 minutes, a temporary database
    python scripts/bench_page.py -n 20000 --repeat 5

The proxy spends at most ``RENDER_SHARE`` of one core on the live page (``serve/admin.py``
``render_gap``): a picture that took ``c`` CPU seconds is followed by the next no sooner than
``max(1 s, c / RENDER_SHARE)``. This script fills a database with ``-n`` synthetic turns (bench_report's
columns) spread over the live page's window ending now, plus a scrape every 5 s, then draws the page's
picture as the proxy does (``LivePages.fragment``, in the thread's CPU time as ``serve/admin.py`` counts
it, the first one apart) and prints the CPU per picture, the gap ``render_gap`` gives it, and, to read
the figure on a noisy shared machine, its ratio to a baseline measured in the same run (the window's
report columns ``SELECT``ed into Python lists); then the same picture with every turn of the window
drawn (no ``MAX_TURNS`` cap), for comparison.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from bench_report import synth_columns  # noqa: E402

from specproxy.analyze.report_data import REPORT_COLUMNS  # noqa: E402
from specproxy.record import FIELD_NAMES  # noqa: E402
from specproxy.serve.admin import render_gap  # noqa: E402
from specproxy.store.db import open_store  # noqa: E402
from specproxy.view.live import WINDOW_S, LivePages  # noqa: E402


def fill(path: Path, n: int, now: float) -> None:
    """``n`` turns over the live window ending ``now`` (the newest a little before it), and scrapes."""
    cols, t_a, t_b = synth_columns(n)
    start = now - WINDOW_S * 0.95
    t_wall = start + (np.asarray(cols["t_wall"]) - t_a) / (t_b - t_a) * (WINDOW_S * 0.9)
    cols["t_wall"] = t_wall.tolist()
    cols["instance_id"] = ["llamacpp-a1b2c3"] * n
    for f in FIELD_NAMES:
        cols.setdefault(f, [None] * n)
    conn = open_store(path)
    conn.execute("PRAGMA synchronous=OFF")
    names = list(FIELD_NAMES)
    conn.execute("BEGIN")
    conn.executemany(f"INSERT INTO turns ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                     zip(*(cols[f] for f in names)))
    scrape_cols = [r[1] for r in conn.execute("PRAGMA table_info(scrapes)") if r[1] != "id"]
    rows = []
    for i, t in enumerate(np.arange(start, now, 5.0).tolist()):
        gen = 4000.0 * i
        row = {"t_wall": t, "t_mono": t - start, "instance_id": "llamacpp-a1b2c3", "server_kind": "llamacpp",
               "requests_running": float(i % 9), "requests_waiting": 0.0, "generation_tokens_total": gen,
               "prompt_tokens_total": 3 * gen, "spec_drafts_total": gen / 2.4, "spec_draft_tokens_total": gen / 1.2,
               "spec_accepted_tokens_total": gen * 0.58}
        rows.append(tuple(row.get(c) for c in scrape_cols))
    conn.executemany(f"INSERT INTO scrapes ({', '.join(scrape_cols)}) VALUES ({', '.join('?' * len(scrape_cols))})",
                     rows)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def baseline(db: Path, since: float) -> float:
    t0 = time.perf_counter()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = conn.execute(f"SELECT {', '.join(REPORT_COLUMNS)} FROM turns WHERE t_wall >= ? ORDER BY t_wall",
                        (since,)).fetchall()
    cols = [list(c) for c in zip(*rows)]
    conn.close()
    del rows, cols
    return time.perf_counter() - t0


def cpu(draw) -> float:
    t0 = time.thread_time()
    draw()
    return time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100_000, help="turns in the window")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "page.db"
        now = time.time()
        fill(db, args.n, now)
        pages = LivePages(str(db))
        first = cpu(pages.fragment)
        times = [cpu(pages.fragment) for _ in range(args.repeat)]
        base = statistics.median(baseline(db, now - WINDOW_S) for _ in range(args.repeat))
        med = statistics.median(times)
        print(f"{args.n} turns in the window: first picture {first:.3f} s CPU, then median {med:.3f} s "
              f"(min {min(times):.3f}); {med / base:.2f}x the baseline ({base:.3f} s: the window's report columns "
              f"read into Python lists)")
        print(f"render_gap: a picture every {render_gap(med):.1f} s at that cost")
        whole = statistics.median(cpu(LivePages(str(db), max_turns=args.n + 1).fragment) for _ in range(args.repeat))
        print(f"without the cap of {pages.max_turns} turns (all {args.n} drawn): {whole:.3f} s CPU, a picture every "
              f"{render_gap(whole):.1f} s")


if __name__ == "__main__":
    main()
