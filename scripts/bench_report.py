"""How long ``specproxy report`` takes over a large database (issue 7: under 5 s for 1M turns).

    python scripts/bench_report.py                    # 1,000,000 turns, a fresh temporary database
    python scripts/bench_report.py -n 200000
    python scripts/bench_report.py --db /tmp/1m.db    # keep (or reuse) the generated database

Generates the database with the store's own migrations and ``executemany`` of synthetic but plausible
rows (numpy-made columns: a week of traffic, two labels, two server instances, concurrency 1-512, a
few percent errors and aborts, NULLs where a real turn has them), plus the scrapes a ``serve`` polling
every 5 s would have stored. Then, in one run:

* a baseline measured in the same run, so that a noisy shared machine can still be read: the report's
  columns ``SELECT``ed with sqlite3 into Python lists (no numpy, no statistics); every CLI time is
  also printed as a ratio to it;
* the CLI as a user runs it (wall time including the interpreter's start and imports):
  ``specproxy report --no-cache`` (SQLite only), cold (the columnar cache ``DB.cache/`` removed
  first, so this run builds it) and warm (the cache present), ``--repeat`` times each;
* in process, the warm path: ``load_turns(db, cache=True)``, ``build_report(turns, conn=...)`` and
  ``render_text`` timed apart, then once under cProfile with the top costs.
"""

from __future__ import annotations
import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from benchlib import cpu_model  # noqa: E402


import argparse
import cProfile
import datetime as _dt
import io
import os
import platform
import pstats
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from specproxy.store import column_cache  # noqa: E402
from specproxy.store.dataset import load_turns  # noqa: E402
from specproxy.record import FIELD_NAMES  # noqa: E402
from specproxy.analyze.report import REPORT_COLUMNS, build_report, render_text  # noqa: E402
from specproxy.store.db import connect, open_store  # noqa: E402


def _cpu_model() -> str:
    return cpu_model()


def _maybe_null(rng: np.random.Generator, values: np.ndarray, p: float) -> list:
    """A column as a Python list with a fraction p of NULLs (None)."""
    out = values.tolist()
    for i in np.flatnonzero(rng.random(len(out)) < p).tolist():
        out[i] = None
    return out


def synth_columns(n: int, seed: int = 7) -> tuple[dict[str, list], float, float]:
    rng = np.random.default_rng(seed)
    t_start = 1_790_000_000.0
    span = 7 * 86400.0
    t_wall = np.sort(t_start + rng.random(n) * span)
    conc = np.minimum(512, np.maximum(1, np.round(rng.lognormal(2.5, 1.3, n)))).astype(int)
    outcome = rng.choice(["ok", "upstream_error", "client_abort", "upstream_truncated", "upstream_unreachable"],
                         size=n, p=[0.95, 0.015, 0.025, 0.005, 0.005])
    ok = outcome == "ok"
    status = np.where(outcome == "upstream_error", 500, np.where(outcome == "upstream_unreachable", 502, 200))
    prompt = np.maximum(50, rng.lognormal(8.0, 1.0, n)).astype(int)
    system = (prompt * rng.uniform(0.05, 0.3, n)).astype(int)
    tools = (prompt * rng.uniform(0.0, 0.4, n)).astype(int)
    new = np.maximum(1, (prompt * rng.uniform(0.01, 0.1, n)).astype(int))
    history = np.maximum(0, prompt - system - tools - new)
    completion = np.maximum(1, rng.lognormal(5.5, 0.8, n)).astype(int)
    reasoning = np.where(rng.random(n) < 0.3, (completion * rng.uniform(0.2, 0.7, n)).astype(int), 0)
    tool_args = np.where(rng.random(n) < 0.2, (completion * 0.1).astype(int), 0)
    content = np.maximum(0, completion - reasoning - tool_args)
    tpc = rng.choice([1.0, 1.0, 1.6, 2.3, 3.1], size=n)
    chunks = np.maximum(1, np.round(completion / tpc)).astype(int)
    tps_stream = np.maximum(2.0, rng.normal(60.0, 15.0, n) / np.sqrt(np.maximum(1, conc) / 8.0))
    ttft = 0.05 + prompt / rng.uniform(2000, 8000, n) + conc * 0.002 * rng.random(n)
    first = np.minimum(completion, rng.integers(1, 4, n))
    decode = np.maximum(0.0, (completion - first) / tps_stream)
    total = ttft + decode + rng.uniform(0.0005, 0.005, n)
    t_req = 1000.0 + (t_wall - t_start)
    streamed = rng.random(n) < 0.97
    label = rng.choice(["baseline", "eagle3"], size=n)
    half = t_start + span / 2
    instance = np.where(t_wall < half, "llamacpp-a1b2c3", "llamacpp-d4e5f6")
    model = rng.choice(["qwen3-8b", "llama-3.1-8b-instruct"], size=n, p=[0.7, 0.3])
    usage = completion + rng.choice([0, 0, 0, 1], size=n)
    delay = rng.lognormal(np.log(1.5e-4), 0.4, n)
    ids = [f"{i:032x}" for i in rng.integers(0, 2**63, n).tolist()]  # random hex, like uuid4().hex
    timings = '{"prompt_n": 812, "prompt_ms": 101.2, "predicted_n": 240, "predicted_ms": 3012.5, "draft_n": 300, "draft_n_accepted": 211}'
    cols: dict[str, list] = {
        "id": ids,
        "t_wall": t_wall.tolist(),
        "method": ["POST"] * n,
        "path": np.where(rng.random(n) < 0.95, "/v1/chat/completions", "/v1/completions").tolist(),
        "status": status.tolist(),
        "outcome": outcome.tolist(),
        "error": [None if o == "ok" else f"{o}: synthetic" for o in outcome.tolist()],
        "streamed": streamed.astype(int).tolist(),
        "model": model.tolist(),
        "label": label.tolist(),
        "instance_id": instance.tolist(),
        "request_parsed": [1] * n,
        "concurrency": conc.tolist(),
        "t_request": t_req.tolist(),
        "t_upstream_headers": (t_req + ttft * 0.9).tolist(),
        "t_first_token": (t_req + ttft).tolist(),
        "t_last_token": (t_req + ttft + decode).tolist(),
        "t_done": (t_req + total).tolist(),
        "ttft_s": ttft.tolist(),
        "decode_s": _maybe_null(rng, decode, 0.03),
        "total_s": total.tolist(),
        "completion_tokens": completion.tolist(),
        "content_tokens": content.tolist(),
        "reasoning_tokens": reasoning.tolist(),
        "tool_args_tokens": tool_args.tolist(),
        "first_chunk_tokens": first.tolist(),
        "usage_completion_tokens": _maybe_null(rng, usage, 0.2),
        "usage_prompt_tokens": _maybe_null(rng, prompt, 0.2),
        "chunks": chunks.tolist(),
        "tokens_per_chunk": (completion / chunks).tolist(),
        "decode_tps": _maybe_null(rng, (completion - first) / np.maximum(decode, 1e-6), 0.03),
        "prompt_tokens": prompt.tolist(),
        "prompt_system_tokens": system.tolist(),
        "prompt_tools_tokens": tools.tolist(),
        "prompt_history_tokens": history.tolist(),
        "prompt_new_tokens": new.tolist(),
        "proxy_delay_s": delay.tolist(),
        "request_bytes": (prompt * 4).tolist(),
        "response_bytes": (chunks * 230).tolist(),
        "saw_done": np.where(streamed, ok, False).astype(int).tolist(),
        "finish_reason": np.where(ok, "stop", None).tolist(),
        "server_timings": np.where(rng.random(n) < 0.5, timings, None).tolist(),
        "tokenizer": ["tiktoken:o200k_base"] * n,
        "prompt_text": [None] * n,
        "response_text": [None] * n,
    }
    # failed turns: nothing measured past the failure
    for name in ("t_first_token", "t_last_token", "ttft_s", "decode_s", "decode_tps", "completion_tokens",
                 "chunks", "tokens_per_chunk"):
        col = cols[name]
        for i in np.flatnonzero(outcome == "upstream_unreachable").tolist():
            col[i] = None
    return cols, t_start, t_start + span


def generate(path: Path, n: int) -> float:
    t0 = time.perf_counter()
    conn = open_store(path)
    conn.execute("PRAGMA synchronous=OFF")
    cols, t_a, t_b = synth_columns(n)
    missing = [f for f in FIELD_NAMES if f not in cols]
    if missing:  # the schema grew since this script was written: leave new columns NULL
        for f in missing:
            cols[f] = [None] * n
    names = list(FIELD_NAMES)
    sql = f"INSERT INTO turns ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    conn.execute("BEGIN")
    conn.executemany(sql, zip(*(cols[f] for f in names)))
    # the scrapes a serve polling every 5 s stores: llama.cpp counters, a restart half-way
    scrape_cols = [r[1] for r in conn.execute("PRAGMA table_info(scrapes)")]
    if scrape_cols:
        ts = np.arange(t_a, t_b, 5.0)
        half = t_a + (t_b - t_a) / 2
        gen = np.cumsum(np.full(len(ts), 400.0))
        rows = []
        for i, t in enumerate(ts.tolist()):
            restarted = t >= half
            base = gen[int(len(ts) / 2)] if restarted else 0.0
            row = {
                "t_wall": t, "t_mono": t - t_a, "instance_id": "llamacpp-d4e5f6" if restarted else "llamacpp-a1b2c3",
                "server_kind": "llamacpp", "requests_running": float(i % 9), "requests_waiting": 0.0,
                "generation_tokens_total": float(gen[i] - base), "prompt_tokens_total": float(3 * (gen[i] - base)),
                "spec_drafts_total": float((gen[i] - base) / 2.4), "spec_draft_tokens_total": float((gen[i] - base) / 1.2),
                "spec_accepted_tokens_total": float((gen[i] - base) * 0.58), "spec_accept_length": None,
                "spec_accept_rate": None, "raw": None, "error": None,
            }
            rows.append(tuple(row.get(c) for c in scrape_cols if c != "id"))
        names_s = [c for c in scrape_cols if c != "id"]
        conn.execute("BEGIN") if not conn.in_transaction else None
        conn.executemany(f"INSERT INTO scrapes ({', '.join(names_s)}) VALUES ({', '.join('?' * len(names_s))})", rows)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - t0


def run_once(db: Path, cache: bool = True) -> tuple[float, float, float, dict]:
    t0 = time.perf_counter()
    conn = connect(db, readonly=True)
    try:
        turns = load_turns(conn, columns=REPORT_COLUMNS, cache=cache)
        t1 = time.perf_counter()
        r = build_report(turns, source=str(db), conn=conn)  # as the CLI calls it
    finally:
        conn.close()
    t2 = time.perf_counter()
    render_text(r)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, r


def baseline(db: Path) -> float:
    """The report's columns SELECTed with sqlite3 into Python lists: what any reader of SQLite pays."""
    names = [c for c in REPORT_COLUMNS]
    t0 = time.perf_counter()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = conn.execute(f"SELECT rowid, {', '.join(names)} FROM turns ORDER BY t_wall, rowid").fetchall()
    cols = [list(c) for c in zip(*rows)]
    conn.close()
    del rows, cols
    return time.perf_counter() - t0


def schema_ok(db: Path) -> bool:
    try:
        have = {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(turns)")}
    except sqlite3.Error:
        return False
    return set(FIELD_NAMES) <= have


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1_000_000, help="turns [1000000]")
    ap.add_argument("--db", help="database to generate, or reuse when it already holds n turns of today's schema")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each CLI variant and in-process [3]")
    ap.add_argument("--top", type=int, default=15, help="profile rows to print [15]")
    args = ap.parse_args()
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]])
    tmpdir = None
    if args.db:
        db = Path(args.db)
    else:
        tmpdir = Path(tempfile.mkdtemp(prefix="bench-report-"))
        db = tmpdir / "turns.db"
    cdir = column_cache.cache_dir(db)
    have = 0
    if db.exists():
        try:
            have = sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0]
        except sqlite3.Error:
            have = -1
    if have == args.n and schema_ok(db):
        gen_s = None
        print(f"reusing {db} ({have:,} turns)", file=sys.stderr)
    else:
        if db.exists():
            for suffix in ("", "-wal", "-shm"):
                Path(str(db) + suffix).unlink(missing_ok=True)
        shutil.rmtree(cdir, ignore_errors=True)
        gen_s = generate(db, args.n)
        print(f"generated {args.n:,} turns in {gen_s:.1f} s -> {db} ({db.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cli(*extra: str) -> tuple[float, int, bytes]:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "report", "--db", str(db), "--json", *extra],
                           capture_output=True, env=env, cwd=str(ROOT))
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            print(p.stderr.decode()[-2000:], file=sys.stderr)
        return wall, p.returncode, p.stdout

    # interleaved, so that a slow minute of the shared machine touches every variant alike
    base, plain, cold, warm, failed = [], [], [], [], []
    outputs = set()
    for i in range(args.repeat):
        base.append(baseline(db))
        w, rc, out = cli("--no-cache")
        plain.append(w)
        outputs.add(out)
        failed += [rc] if rc else []
        shutil.rmtree(cdir, ignore_errors=True)
        w, rc, out = cli()
        cold.append(w)
        outputs.add(out)
        failed += [rc] if rc else []
        for _ in range(2):
            w, rc, out = cli()
            warm.append(w)
            outputs.add(out)
            failed += [rc] if rc else []
        print(f"round {i + 1}: baseline {base[-1]:.2f} s, --no-cache {plain[-1]:.2f} s, cold {cold[-1]:.2f} s, "
              f"warm {warm[-2]:.2f} / {warm[-1]:.2f} s", file=sys.stderr)
    same = len(outputs) == 1
    cache_mib = sum(f.stat().st_size for f in cdir.rglob("*") if f.is_file()) / 2**20 if cdir.exists() else 0.0

    runs = []
    for i in range(args.repeat):
        load_s, build_s, render_s, r = run_once(db)
        runs.append((load_s, build_s, render_s))
        print(f"in-process warm run {i + 1} ({column_cache.last_status}): load {load_s:.2f} s + build {build_s:.2f} s"
              f" + render {render_s:.3f} s = {load_s + build_s + render_s:.2f} s ({r['turns']:,} turns)", file=sys.stderr)

    prof = cProfile.Profile()
    prof.enable()
    run_once(db)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    prof_tottime = buf.getvalue()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(r"specproxy|numpy|sqlite3", args.top)
    prof_cum = buf.getvalue()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import specproxy.app.cli, specproxy.analyze.report, specproxy.store.dataset"], env=env, cwd=str(ROOT))
    import_s = time.perf_counter() - t0

    def stat(xs, spec="{:.2f}"):
        return f"{spec.format(statistics.median(xs))} ({spec.format(min(xs))}–{spec.format(max(xs))})"

    b = statistics.median(base)

    def ratio(xs):
        return f"{statistics.median(xs) / b:.2f}x"

    print()
    print(f"### specproxy report: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}, nproc {os.cpu_count()}, "
          f"{_cpu_model()}, SQLite {sqlite3.sqlite_version}, Python {platform.python_version()}, numpy {np.__version__}")
    print()
    print(f"`{cmd}`")
    print()
    size = db.stat().st_size / 2**20
    gen = f"generated in {gen_s:.1f} s" if gen_s is not None else "reused"
    print(f"{args.n:,} synthetic turns ({size:.0f} MiB, {gen}); cache {cache_mib:.0f} MiB in {cdir.name}/. "
          f"Median of {args.repeat} rounds (min–max), variants interleaved; ratios to the baseline of the same run.")
    print()
    print("| what | seconds | / baseline |")
    print("|---|---:|---:|")
    print(f"| baseline: the report's {len(REPORT_COLUMNS)} columns `SELECT`ed with sqlite3 into Python lists | {stat(base)} | 1.00x |")
    print(f"| CLI `specproxy report --json --no-cache` (SQLite only) | {stat(plain)} | {ratio(plain)} |")
    print(f"| CLI `specproxy report --json`, cold: builds `{cdir.name}/` | {stat(cold)} | {ratio(cold)} |")
    print(f"| CLI `specproxy report --json`, warm: cache present | {stat(warm)} | {ratio(warm)} |")
    print(f"| (CLI: interpreter start + imports alone) | {import_s:.2f} | |")
    print(f"| in-process warm: `load_turns(..., cache=True)` | {stat([x[0] for x in runs])} | |")
    print(f"| in-process warm: `build_report(turns, conn=...)` | {stat([x[1] for x in runs])} | |")
    print(f"| in-process warm: `render_text(report)` | {stat([x[2] for x in runs], '{:.3f}')} | |")
    print()
    print(f"Outputs of every CLI run identical (no cache, cold, warm): {'yes' if same else '**NO**'}"
          f"{'' if not failed else f'; exit statuses {failed}'}.")
    verdict = "met" if statistics.median(warm) < 5.0 and not failed and same else "**not met**"
    print(f"Target: report over {args.n:,} turns in under 5 s: warm CLI {statistics.median(warm):.2f} s "
          f"(cold {statistics.median(cold):.2f} s, no cache {statistics.median(plain):.2f} s) -> {verdict}.")
    print()
    print("Profile of one in-process warm run (cProfile inflates Python-heavy code), top by own time:")
    print()
    print("```")
    print("\n".join(line for line in prof_tottime.splitlines() if line.strip())[:6000])
    print("```")
    print()
    print("Top by cumulative time (specproxy, numpy, sqlite3 frames):")
    print()
    print("```")
    print("\n".join(line for line in prof_cum.splitlines() if line.strip())[:6000])
    print("```")
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    main()
