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
* in process, the warm path: ``SQLiteSource(db, cache=True).load(...)``, ``build_report(data)`` and
  ``render_text`` timed apart, then once under cProfile with the top costs;
* with ``--against main``, that revision's report (its tree from ``git archive``) on the same database,
  its JSON compared with this code's field by field.

Each CLI run's peak RSS (``wait4``'s ``ru_maxrss``) is printed beside its time. The database is
generated 250k turns at a time, so 50M turns take no more memory than 250k.
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
import orjson  # noqa: E402

from specproxy.store import column_cache  # noqa: E402
from specproxy.store.source import Window  # noqa: E402
from specproxy.store.sqlite_source import SQLiteSource  # noqa: E402
from specproxy.record import FIELD_NAMES  # noqa: E402
from specproxy.analyze.report_data import REPORT_COLUMNS, build_report  # noqa: E402
from specproxy.analyze.report import render_text  # noqa: E402
from specproxy.store.db import open_store  # noqa: E402


def _cpu_model() -> str:
    return cpu_model()


def _maybe_null(rng: np.random.Generator, values: np.ndarray, p: float) -> list:
    """A column as a Python list with a fraction p of NULLs (None)."""
    out = values.tolist()
    for i in np.flatnonzero(rng.random(len(out)) < p).tolist():
        out[i] = None
    return out


SPAN = 7 * 86400.0  # a week of traffic, whatever n
T_START = 1_790_000_000.0
CHUNK = 250_000  # turns made and written at a time: memory bounded by a chunk, not by n


def synth_columns(n: int, seed: int = 7, t_from: float = T_START, t_to: float = T_START + SPAN
                  ) -> tuple[dict[str, list], float, float]:
    """n turns with wall times in [t_from, t_to), sorted: one chunk of the generated week."""
    rng = np.random.default_rng(seed)
    t_start, span = T_START, SPAN
    t_wall = np.sort(t_from + rng.random(n) * (t_to - t_from))
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
    """The database, made and written CHUNK turns at a time (each chunk a slice of the week), so that
    50M turns need no more memory than 250k."""
    t0 = time.perf_counter()
    conn = open_store(path)
    conn.execute("PRAGMA synchronous=OFF")
    names = list(FIELD_NAMES)
    sql = f"INSERT INTO turns ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    chunks = max(1, -(-n // CHUNK))
    t_a, t_b = T_START, T_START + SPAN
    conn.execute("BEGIN")
    for k in range(chunks):
        m = n // chunks + (1 if k < n % chunks else 0)
        cols, _, _ = synth_columns(m, seed=7 + k, t_from=t_a + SPAN * k / chunks, t_to=t_a + SPAN * (k + 1) / chunks)
        for f in names:
            cols.setdefault(f, [None] * m)  # the schema grew since this script was written: NULL
        conn.executemany(sql, zip(*(cols[f] for f in names)))
        del cols
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
    with SQLiteSource(db, cache=cache) as store:  # as the CLI loads it
        data = store.load(Window(), REPORT_COLUMNS, server=True, context=True)
    t1 = time.perf_counter()
    r = build_report(data, source=str(db))
    t2 = time.perf_counter()
    render_text(r)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, r


def baseline(db: Path) -> float:
    """The report's columns SELECTed with sqlite3 into Python lists: what any reader of SQLite pays.

    Run in a child process: Linux gives a child the RSS of the parent it was forked from as its starting
    peak (``ru_maxrss`` survives exec), so a parent that had held a month of rows as Python objects
    would report gigabytes for every CLI run it starts afterwards."""
    code = ("import sqlite3, sys, time\n"
            "t0 = time.perf_counter()\n"
            "conn = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True)\n"
            "rows = conn.execute(sys.argv[2]).fetchall()\n"
            "cols = [list(c) for c in zip(*rows)]\n"
            "print(time.perf_counter() - t0)\n")
    sql = f"SELECT rowid, {', '.join(REPORT_COLUMNS)} FROM turns ORDER BY t_wall, rowid"
    out = subprocess.run([sys.executable, "-c", code, str(db), sql], capture_output=True, text=True, check=True)
    return float(out.stdout)


def _leaves(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def compare_json(old: bytes, new: bytes) -> str:
    """Two reports' JSON, leaf by leaf: identical, or how many leaves differ and by how much at most
    (relative, for numbers; a mean summed in another order differs in its last bits)."""
    if old == new:
        return "identical, byte for byte"
    a, b = dict(_leaves(orjson.loads(old))), dict(_leaves(orjson.loads(new)))
    if set(a) != set(b):
        return f"**fields differ**: {sorted(set(a) ^ set(b))[:10]}"
    diff, worst = [], 0.0
    for k in a:
        if a[k] == b[k]:
            continue
        if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float)) and not isinstance(a[k], bool):
            rel = abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]))
            worst = max(worst, rel)
        else:
            worst = float("inf")
        diff.append(k)
    return (f"{len(a) - len(diff)} of {len(a)} fields identical; {len(diff)} differ by at most {worst:.1e} relative"
            f" ({', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''})")


def against_rev(rev: str, run, new_output: bytes) -> str:
    """REV's tree (git archive) with this tree's built extensions, its report run on the same database."""
    tree = Path(tempfile.mkdtemp(prefix="bench-report-rev-"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for so in (ROOT / "specproxy").rglob("*.so"):
            target = tree / so.relative_to(ROOT)
            if target.parent.exists():
                shutil.copy2(so, target)
        wall, rc, out, peak = run(tree)
        if rc:
            return f"{rev}'s report failed (exit {rc})"
        return f"{rev} ({wall:.1f} s, {peak:.0f} MiB): " + compare_json(out, new_output)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


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
    ap.add_argument("--cli-only", action="store_true", help="the CLI runs and the baseline only: no in-process "
                    "runs or profile (at 10M turns those take as long as the rest)")
    ap.add_argument("--against", metavar="REV", help="also run REV's report (a git revision of this repository, "
                    "e.g. main) and compare its JSON with this code's, figure by figure")
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

    def cli(*extra: str, cmd: str = "report", path: Path = ROOT) -> tuple[float, int, bytes, float]:
        """One CLI run: wall seconds, exit status, stdout, and the process's peak RSS in MiB."""
        run_env = dict(env, PYTHONPATH=str(path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            p = subprocess.Popen([sys.executable, "-m", "specproxy.app.cli", cmd, "--db", str(db), "--json", *extra],
                                 stdout=out, stderr=err, env=run_env, cwd=str(path))
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - t0
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if p.returncode != 0:
            print(stderr.decode()[-2000:], file=sys.stderr)
        return wall, p.returncode, stdout, usage.ru_maxrss / 1024

    # interleaved, so that a slow minute of the shared machine touches every variant alike
    base, plain, cold, warm, failed = [], [], [], [], []
    rss: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    outputs = set()
    for i in range(args.repeat):
        base.append(baseline(db))
        w, rc, out, m = cli("--no-cache")
        plain.append(w)
        rss["plain"].append(m)
        outputs.add(out)
        failed += [rc] if rc else []
        shutil.rmtree(cdir, ignore_errors=True)
        w, rc, out, m = cli()
        cold.append(w)
        rss["cold"].append(m)
        outputs.add(out)
        failed += [rc] if rc else []
        for _ in range(2):
            w, rc, out, m = cli()
            warm.append(w)
            rss["warm"].append(m)
            outputs.add(out)
            failed += [rc] if rc else []
        print(f"round {i + 1}: baseline {base[-1]:.2f} s, --no-cache {plain[-1]:.2f} s, cold {cold[-1]:.2f} s, "
              f"warm {warm[-2]:.2f} / {warm[-1]:.2f} s; peak RSS warm {rss['warm'][-1]:.0f} MiB", file=sys.stderr)
    against = None
    if args.against:
        against = against_rev(args.against, lambda tree: cli("--no-cache", path=tree), next(iter(outputs)))
    same = len(outputs) == 1
    cache_mib = sum(f.stat().st_size for f in cdir.rglob("*") if f.is_file()) / 2**20 if cdir.exists() else 0.0

    runs = []
    for i in range(0 if args.cli_only else args.repeat):
        load_s, build_s, render_s, r = run_once(db)
        runs.append((load_s, build_s, render_s))
        print(f"in-process warm run {i + 1} ({column_cache.last_status}): load {load_s:.2f} s + build {build_s:.2f} s"
              f" + render {render_s:.3f} s = {load_s + build_s + render_s:.2f} s ({r['turns']:,} turns)", file=sys.stderr)

    prof_tottime = prof_cum = "(not run: --cli-only)"
    if not args.cli_only:
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
    def mib(xs):
        return f"{max(xs):.0f}"

    print("| what | seconds | / baseline | peak RSS MiB (max) |")
    print("|---|---:|---:|---:|")
    print(f"| baseline: the report's {len(REPORT_COLUMNS)} columns `SELECT`ed with sqlite3 into Python lists | {stat(base)} | 1.00x | |")
    print(f"| CLI `specproxy report --json --no-cache` (SQLite only) | {stat(plain)} | {ratio(plain)} | {mib(rss['plain'])} |")
    print(f"| CLI `specproxy report --json`, cold: builds `{cdir.name}/` | {stat(cold)} | {ratio(cold)} | {mib(rss['cold'])} |")
    print(f"| CLI `specproxy report --json`, warm: cache present | {stat(warm)} | {ratio(warm)} | {mib(rss['warm'])} |")
    print(f"| (CLI: interpreter start + imports alone) | {import_s:.2f} | | |")
    if runs:
        print(f"| in-process warm: `SQLiteSource.load(...)` | {stat([x[0] for x in runs])} | | |")
        print(f"| in-process warm: `build_report(data)` | {stat([x[1] for x in runs])} | | |")
        print(f"| in-process warm: `render_text(report)` | {stat([x[2] for x in runs], '{:.3f}')} | | |")
    print()
    print(f"Outputs of every CLI run identical (no cache, cold, warm): {'yes' if same else '**NO**'}"
          f"{'' if not failed else f'; exit statuses {failed}'}.")
    if against is not None:
        print(f"Against {against}.")
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
