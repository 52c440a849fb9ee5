"""``bench_overhead.py``'s summaries: medians over rounds with their ranges, the ratios to direct and to
nginx, and the Markdown tables it prints (the results, CPU by thread, the issue's targets)."""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WITH_OTLP = "specproxy+otlp"  # the same specproxy with --otlp-endpoint (--with-otlp)
WITH_SINK = "specproxy+sink"  # with --sink postgresql://... (--with-sink)
WITH_SINK_OTLP = "specproxy+sink+otlp"  # with both (--with-sink --with-otlp): issue 35's case
BASELINE = "specproxy-base"  # --specproxy-baseline: the same benchmark's specproxy from another checkout
# --with-unmeasured: the same specproxy, the same streams, asked for on a path it forwards and records without
# measuring (not a generation endpoint): what forwarding and storing cost, measuring apart
UNMEASURED = "specproxy-unmeasured"
UNMEASURED_PATH = "/v1/bench/unmeasured"
PROXY_PATHS = ("nginx", "specproxy", WITH_OTLP, WITH_SINK, WITH_SINK_OTLP, BASELINE, UNMEASURED)  # the paths with a process to read
OTLP_INTERVAL_S = 5.0  # several exports inside each measured window's lifetime (the default is 15 s)
SHIPPER_THREAD = "specproxy-ship"  # store/shipper.py's thread, by the name the benchmark reads it under


def _med(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def _fmt(stat, spec: str = "{:.0f}", mm: bool = True) -> str:
    if stat is None:
        return "-"
    m, lo, hi = stat
    s = spec.format(m)
    if mm and (lo != hi):
        s += f" ({spec.format(lo)}–{spec.format(hi)})"
    return s


def summarize(runs: list[dict], cs: list[int], paths: list[str]) -> dict:
    """Per (C, path): medians and min-max over rounds; ratios computed within each round."""
    by: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["conns"], r["path"]), []).append(r)
    out = {}
    for c in cs:
        direct = {r["round"]: r for r in by.get((c, "direct"), [])}
        nginx = {r["round"]: r for r in by.get((c, "nginx"), [])}
        for p in paths:
            rs = by.get((c, p), [])
            if not rs:
                continue
            row = {"rounds": len(rs)}
            row["chunks_per_s"] = _med([r["chunks_per_s"] for r in rs])
            row["x_direct"] = _med([r["chunks_per_s"] / direct[r["round"]]["chunks_per_s"] for r in rs if r["round"] in direct])
            for q in ("p50", "p99", "p99.9"):
                row[q] = _med([r["lat_us"].get(q) for r in rs])
                row["added_" + q] = _med(
                    [r["lat_us"][q] - direct[r["round"]]["lat_us"][q] for r in rs if r["round"] in direct]
                ) if p != "direct" else None
            for q in ("p50", "p99"):  # a turn's first chunk alone (older load generators did not split it)
                row["first_added_" + q] = _med(
                    [r["first_lat_us"][q] - direct[r["round"]]["first_lat_us"][q] for r in rs
                     if r["round"] in direct and q in r.get("first_lat_us", {})
                     and q in direct[r["round"]].get("first_lat_us", {})]
                ) if p != "direct" else None
            row["cpu_us"] = _med([r["cpu_us_per_chunk"] for r in rs])
            row["sched_us"] = _med([r["sched_us_per_chunk"] for r in rs])
            row["cpu_util"] = _med([r["proxy_cpu_util"] for r in rs])
            for key, col in (("cpu_x_nginx", "cpu_us_per_chunk"), ("sched_x_nginx", "sched_us_per_chunk")):
                row[key] = _med(
                    [r[col] / nginx[r["round"]][col] for r in rs
                     if r["round"] in nginx and r[col] and nginx[r["round"]][col]]
                ) if p != "direct" else None
            row["load_util"] = _med([r["load_cpu_util"] for r in rs])
            row["errors"] = sum(r["errors"] for r in rs)
            row["turns"] = sum(r["turns"] for r in rs)
            row["rss_mib"] = max((r.get("rss_kb") or 0) for r in rs) / 1024 or None
            out[(c, p)] = row
    return out


def render(summary: dict, cs: list[int], paths: list[str], meta: dict, held: dict[int, bool]) -> str:
    L = []
    L.append(f"### specproxy overhead: {meta['date']}, nproc {meta['nproc']}, {meta['cpu']}")
    L.append("")
    L.append(f"`{meta['command']}` (specproxy {meta['git']}, Python {meta['python']})")
    L.append("")
    L.append(f"Upstream: {meta['stream_mode']} decode-step clock, {meta['step_ms']:g} ms per step, "
             f"{meta['tokens'][0]}–{meta['tokens'][1]} chunks per turn, ~{meta['prompt_bytes']} B prompts; "
             f"{meta['rounds']} rounds of {meta['warmup']:g} s warm-up + {meta['measure']:g} s measured, paths in rotating order; "
             f"proxy pinned to CPU {meta['proxy_cores']}, upstream + load generator to CPU {meta['load_cores']}. "
             f"specproxy: full measurement (tiktoken:o200k_base, SQLite); nginx {meta['nginx_version']}: 1 worker, "
             f"proxy_buffering off. Median over rounds (min–max). Added latency = the path's per-chunk latency "
             f"percentile minus direct's in the same round. CPU: utime+stime from /proc/PID/stat (10 ms ticks: "
             f"coarse at C=1) and on-CPU time from /proc/PID/task/*/schedstat (ns), all threads, nginx master + worker, "
             f"÷ chunks received in the window. This machine's cross-CPU wake-up latency (pipe write every 10 ms, "
             f"reader idle in between): p50 {meta['wake'][0]:.0f} µs, p99 {meta['wake'][1]:.0f} µs, max {meta['wake'][2]:.0f} µs: "
             f"a floor under any proxy's added latency here.")
    L.append("")
    L.append("| C | path | chunks/s | × direct | latency p50 / p99 (µs) | added p50 (µs) | added p99 (µs) "
             "| CPU µs/chunk (stat) | × nginx | CPU µs/chunk (schedstat) | × nginx | proxy CPU (cores) | peak RSS (MiB) |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in cs:
        for p in paths:
            row = summary.get((c, p))
            if row is None:
                continue
            lat = f"{_fmt(row['p50'], mm=False)} / {_fmt(row['p99'], mm=False)}"
            cflag = "" if held.get(c, True) else " †"
            L.append(
                f"| {c}{cflag} | {p} | {_fmt(row['chunks_per_s'])} | {_fmt(row['x_direct'], '{:.3f}')} | {lat} "
                f"| {_fmt(row['added_p50'])} | {_fmt(row['added_p99'])} | {_fmt(row['cpu_us'], '{:.1f}')} "
                f"| {_fmt(row['cpu_x_nginx'], '{:.2f}')} | {_fmt(row['sched_us'], '{:.1f}')} "
                f"| {_fmt(row['sched_x_nginx'], '{:.2f}')} | {_fmt(row['cpu_util'], '{:.2f}', mm=False)} "
                f"| {('%.0f' % row['rss_mib']) if row['rss_mib'] else '-'} |"
            )
    if not all(held.values()):
        L.append("")
        L.append("† the load side (upstream + load generator) could not hold the nominal rate at this C on this "
                 "machine even direct: read those rows as indicative.")
    return "\n".join(L)


def render_first_chunks(summary: dict, cs: list[int], paths: list[str]) -> str | None:
    """Each path's added latency of a turn's first chunk alone, beside that of every chunk. Why: with
    ~100 chunks a turn, first chunks are ~1% of all, so a slower first chunk is where the p99 of every
    chunk sits; and through specproxy a first chunk that comes with the response head crosses the event
    loop's per-turn path, the others the relay thread alone."""
    rows = [(c, p, summary[(c, p)]) for c in cs for p in paths
            if p != "direct" and (c, p) in summary and summary[(c, p)].get("first_added_p99")]
    if not rows:
        return None
    L = ["A turn's first chunk, against all chunks (µs added to direct's in the same round, median over rounds; "
         "first chunks are about 1% of all, where p99 sits; through specproxy one that comes with the response "
         "head is written on the event loop's thread, as the relay thread's turn begins; the rest by the relay "
         "thread):", "",
         "| C | path | first chunk: added p50 | added p99 | all chunks: added p50 | added p99 |",
         "|---:|---|---:|---:|---:|---:|"]
    for c, p, row in rows:
        L.append(f"| {c} | {p} | {_fmt(row['first_added_p50'])} | {_fmt(row['first_added_p99'])} "
                 f"| {_fmt(row['added_p50'])} | {_fmt(row['added_p99'])} |")
    return "\n".join(L)


def git_state(root: Path = ROOT) -> str:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "specproxy"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        changed = sorted(line[3:].split("/")[-1] for line in dirty if line.strip())
        return f"{head}" + (f" + uncommitted {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def render_threads(runs: list[dict], c: int) -> str:
    """Per-thread user/system CPU per chunk of the proxies at concurrency c (median over rounds)."""
    L = [f"Where the proxy's CPU goes at C={c} (µs per chunk, median over rounds; user = in the process, "
         "sys = in the kernel for it: its syscalls, and the loopback TCP delivery they trigger; per turn: the same "
         "CPU in µs per turn the load generator completed, the total times the window's chunks per turn, the "
         "figure to read for work done once a turn):", "",
         "| path | thread | user | sys | total | per turn |", "|---|---|---:|---:|---:|---:|"]
    for path in PROXY_PATHS:
        rs = [r for r in runs if r["conns"] == c and r["path"] == path and r.get("threads")]
        if not rs:
            continue
        per: dict[str, list[tuple[float, float]]] = {}
        per_turn = statistics.median(r["chunks"] / r["turns"] if r.get("chunks") and r.get("turns") else math.nan
                                     for r in rs)  # chunks per turn completed in the window
        for r in rs:
            agg: dict[str, list[float]] = {}
            for tid, (u, sy) in r["threads"].items():
                name = r.get("thread_names", {}).get(tid, f"tid {tid}")
                a = agg.setdefault(name, [0.0, 0.0])
                a[0] += u
                a[1] += sy
            for name, (u, sy) in agg.items():
                per.setdefault(name, []).append((u, sy))
        rows = sorted(((name, statistics.median(u for u, _ in v), statistics.median(sy for _, sy in v))
                       for name, v in per.items()), key=lambda x: -(x[1] + x[2]))
        for name, u, sy in rows:
            if u + sy >= 0.05:
                L.append(f"| {path} | {name} | {u:.1f} | {sy:.1f} | {u + sy:.1f} | {(u + sy) * per_turn:,.0f} |")
        total = sum(r[1] + r[2] for r in rows)
        L.append(f"| {path} | **all** | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f} | "
                 f"**{total:.1f}** | {total * per_turn:,.0f} |")
        L.append(f"| {path} | (chunks per turn) | | | | {per_turn:.0f} |")
    return "\n".join(L)


def render_targets(summary: dict, cs: list[int], path: str = "specproxy") -> str:
    """Issue 33's targets for specproxy, or for one of its variants (``--with-sink``/``--with-otlp``:
    issue 35 asks that they hold with a sink and OTLP on)."""
    who = "" if path == "specproxy" else f", {path}"
    L = [f"| target (issue 33{who}) | measured | verdict |", "|---|---:|---|"]

    def add(name, stat, limit, spec, better="le"):
        if stat is None:
            L.append(f"| {name} | - | not measured |")
            return
        ok = stat[0] <= limit if better == "le" else stat[0] >= limit
        L.append(f"| {name} | {_fmt(stat, spec)} | {'met' if ok else '**not met**'} |")

    c_hi = 256 if 256 in cs else max(cs)
    sp = summary.get((c_hi, path))
    if sp:
        add(f"C={c_hi}: CPU per chunk ≤ 1.2× nginx (utime+stime)", sp["cpu_x_nginx"], 1.2, "{:.2f}×")
        add(f"C={c_hi}: CPU per chunk ≤ 1.2× nginx (schedstat)", sp["sched_x_nginx"], 1.2, "{:.2f}×")
        add(f"C={c_hi}: added p99 per chunk ≤ 1000 µs", sp["added_p99"], 1000, "{:.0f} µs")
        add(f"C={c_hi}: chunks/s ≥ 0.99× direct", sp["x_direct"], 0.99, "{:.3f}×", "ge")
    s1 = summary.get((1, path)) if 1 in cs else None
    if s1:
        add("C=1: added p50 ≤ 50 µs", s1["added_p50"], 50, "{:.0f} µs")
    return "\n".join(L)


def render_polls(polls: dict[int, dict[str, float]]) -> str:
    """specproxy's cadence poll at each C (``serve --cadence-poll``; its state line, over all the C's
    rounds, warm-ups and the gaps between windows included): the CPU it spent is in the CPU columns."""
    parts = []
    for c, p in sorted(polls.items()):
        if p["poll_windows"] <= 0:
            parts.append(f"C = {c}: none")
            continue
        parts.append(f"C = {c}: {p['poll_windows']:,.0f} windows, {p['poll_hits'] / p['poll_windows']:.0%} caught "
                     f"their token, {p['poll_s'] / p['poll_windows'] * 1e6:,.0f} µs polled per window")
    return ("specproxy's cadence poll (its state line; polling is in its CPU above): " + "; ".join(parts) + ".")


def render_baseline(runs: list[dict], cs: list[int], base_git: str) -> str:
    """``--specproxy-baseline``: this checkout's specproxy against the baseline checkout's, per C."""
    return render_versus(runs, cs, "specproxy", BASELINE,
                         f"This checkout's specproxy against the baseline's ({base_git}), run in the same rounds: "
                         "median over rounds of the per-round ratio this / baseline (min–max; below 1: this "
                         "one is cheaper or faster)")


def render_versus(runs: list[dict], cs: list[int], path: str, base_path: str, title: str) -> str:
    """Two paths that ran in the same rounds, in rotating order, per C: the per-round ratios ``path`` /
    ``base_path`` of CPU per chunk and of latency (within a round, so the machine's drift cancels)."""
    L = [title, "",
         "| C | CPU µs/chunk (schedstat) × | chunks/s × | latency p50 × | latency p99 × |", "|---:|---:|---:|---:|---:|"]
    for c in cs:
        by = {(r["path"], r["round"]): r for r in runs if r["conns"] == c}
        cells = []
        for key, sub in (("sched_us_per_chunk", None), ("chunks_per_s", None), ("lat_us", "p50"), ("lat_us", "p99")):
            ratios = []
            for (p, rnd), r in by.items():
                base = by.get((base_path, rnd))
                if p != path or base is None:
                    continue
                a, b = (r[key], base[key]) if sub is None else (r[key].get(sub), base[key].get(sub))
                if a and b:
                    ratios.append(a / b)
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})" if ratios else "-")
        L.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(L)


def render_otlp(runs: list[dict], cs: list[int], exports: int) -> str:
    """``--with-otlp``: specproxy with OTLP against without, per C."""
    return render_versus(runs, cs, WITH_OTLP, "specproxy", f"OTLP's cost (--otlp-endpoint to a local receiver, every "
                         f"{OTLP_INTERVAL_S:g} s; it took {exports} exports): median over rounds of the per-round "
                         "ratio with / without (min–max)")


def render_measuring(runs: list[dict], cs: list[int]) -> str:
    """``--with-unmeasured``: specproxy measuring its turns against the same streams forwarded unmeasured."""
    return render_versus(runs, cs, "specproxy", UNMEASURED, "Measuring's cost: specproxy on the chat path, every turn "
                         f"measured, against specproxy forwarding the same streams on {UNMEASURED_PATH}, which it "
                         "records unmeasured: median over rounds of the per-round ratio measured / unmeasured (min–max)")


def render_sink(runs: list[dict], cs: list[int]) -> str:
    """``--with-sink``: specproxy with the sink (and with the sink and OTLP, when both ran) against without."""
    parts = []
    for path, what in ((WITH_SINK, "--sink postgresql://... to a local PostgreSQL"),
                       (WITH_SINK_OTLP, "--sink and --otlp-endpoint both, issue 35's case")):
        if any(r["path"] == path for r in runs):
            parts.append(render_versus(runs, cs, path, "specproxy", f"The cost of {path} ({what}): median over rounds of the "
                                       "per-round ratio with / without (min–max)"))
    return "\n\n".join(parts)


def shipper_cpu_s(run: dict) -> float | None:
    """The shipper thread's on-CPU seconds in one window (None: the window's threads were not named)."""
    names, on_cpu = run.get("thread_names"), run.get("threads_on_cpu_s")
    if not names or on_cpu is None:
        return None
    return sum(s for tid, s in on_cpu.items() if names.get(tid) == SHIPPER_THREAD)


def render_shipper(runs: list[dict], cs: list[int], deliveries: dict[str, dict[str, dict]]) -> str:
    """``--with-sink``: what the shipper cost and how far behind it was, per C and sink path, and whether
    every turn arrived (``deliveries[str(C)][path]``: ``overhead_sink.delivered`` and the life figures)."""
    L = [f"The shipper (its thread `{SHIPPER_THREAD}`), median over rounds (min–max): its on-CPU time (schedstat) "
         "per turn the load generator completed in the window, and its share of the proxy's on-CPU time; rows "
         "and seconds behind are its own gauges (`specproxy_sink_*`), read from the state line at each window's "
         "end (the most over rounds); over the proxy's life at that C (warm-ups, gaps and the drain included): "
         "its CPU per turn PostgreSQL holds, and the turns the load generator completed, the proxy recorded "
         "(ok) and PostgreSQL holds (ok) once the shipper caught up.", "",
         "| C | path | CPU µs/turn | share of proxy CPU | rows behind | s behind | batches failed "
         "| µs/turn, life | completed → recorded (ok) → in PostgreSQL (ok) |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cs:
        for path in (WITH_SINK, WITH_SINK_OTLP):
            rs = [r for r in runs if r["conns"] == c and r["path"] == path]
            if not rs:
                continue
            per_turn, share = [], []
            for r in rs:
                ship = shipper_cpu_s(r)
                if ship is not None and r["turns"]:
                    per_turn.append(ship / r["turns"] * 1e6)
                if ship is not None and r.get("proxy_sched_s"):
                    share.append(ship / r["proxy_sched_s"])
            samples = [r["shipper"] for r in rs if r.get("shipper")]
            cell = lambda v, spec: "-" if v is None else spec.format(v)  # noqa: E731
            most = {k: max((s.get(k, 0) for s in samples), default=None)
                    for k in ("sink_rows_behind", "sink_seconds_behind", "sink_batches_failed")}
            d = deliveries.get(str(c), {}).get(path)
            life = f"{d['ship_cpu_s'] / d['in_pg'] * 1e6:.1f}" if d and d.get("in_pg") else "-"
            arrived = "-"
            if d:
                missing = d["recorded"] - d["in_pg"]
                arrived = (f"{d['completed']:,} → {d['recorded']:,} ({d['recorded_ok']:,}) → {d['in_pg']:,} "
                           f"({d['in_pg_ok']:,})" + (" all arrived" if missing == 0 else f" **{missing:,} missing**"))
            L.append(f"| {c} | {path} | {_fmt(_med(per_turn), '{:.1f}')} | {_fmt(_med(share), '{:.1%}')} "
                     f"| {cell(most['sink_rows_behind'], '{:,.0f}')} | {cell(most['sink_seconds_behind'], '{:.2f}')} "
                     f"| {cell(most['sink_batches_failed'], '{:.0f}')} "
                     f"| {life} | {arrived} |")
    return "\n".join(L)
