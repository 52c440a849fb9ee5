"""What specproxy costs on the wire: direct vs nginx vs specproxy, in one run, on this machine.

    python scripts/bench_overhead.py                         # C = 1, 64, 256, 512; 3 rounds (~4 min)
    python scripts/bench_overhead.py --concurrency 1,256 --rounds 3 --measure 4
    python scripts/bench_overhead.py --stream-mode smooth    # streams on their own phase, no bursts
    python scripts/bench_overhead.py --json out.json         # also write every round's raw numbers
    python scripts/bench_overhead.py --with-otlp --no-nginx  # specproxy with and without --otlp-endpoint
    python scripts/bench_overhead.py --with-sink --with-otlp # also with --sink to a local PostgreSQL, and both
    python scripts/bench_overhead.py --specproxy-baseline ../base --no-nginx  # this checkout against another
    python scripts/bench_overhead.py --concurrency 256 --with-unmeasured  # measuring's share of specproxy's CPU
    python scripts/bench_overhead.py --concurrency 256 --rounds 1 --loop-steps  # and the loop's turn by step

Three processes besides this orchestrator, all on 127.0.0.1:

* an upstream (``--role upstream``, its own process): a fake OpenAI-compatible engine on raw asyncio
  Protocols. ``batched`` mode (the default) is a decode-step clock like a real engine: every step
  period each active stream gets one chunk, all of them in one burst. ``smooth`` mode gives each stream
  its own clock with a random phase, so chunks arrive evenly spread. Every chunk carries, as its last
  JSON field, ``"t_send": time.perf_counter_ns()`` taken just before the chunk is written.
* a load generator (``--role loadgen``): C keep-alive HTTP/1.1 connections on a raw asyncio/uvloop
  Protocol (chunked decoding and a byte search for ``"t_send":``, no JSON, no aiohttp), each running
  turn after turn. Per chunk it records ``receive - send`` (same machine, same CLOCK_MONOTONIC), and
  apart the same for each turn's first chunk (printed beside all chunks' added latency: ~1% of the chunks,
  so where p99 sits, and through specproxy the one chunk that can cross the event loop's per-turn path).
* the path under test: nothing (direct), nginx (installed from Debian when missing; ``proxy_buffering
  off``, HTTP/1.1 keepalive upstream, one worker, a non-daemon child), or specproxy
  (``python -m specproxy.app.cli serve`` with ``--tokenizer tiktoken:o200k_base`` and a temp database:
  full measurement on).

The proxy under test is pinned to the last CPU; the upstream, the load generator and this script to the
others. For each concurrency C one nginx and one specproxy are started; then ``--rounds`` rounds run the
three paths in rotating order, each with a warm-up and a measured window of the same absolute length.
Over the window: chunks/s received, per-chunk latency percentiles (added = path's percentile - direct's
percentile in the same round), the proxy's CPU (utime+stime from /proc/PID/stat, and on-CPU ns from
/proc/PID/task/*/schedstat; all its threads, with specproxy's measuring child process and nginx's master + worker) per chunk relayed, and its peak
RSS (VmHWM, max over the rounds at that C). Before the runs it measures the machine's cross-CPU wake-up
latency, a floor under any proxy's added latency (large on VMs whose idle vCPUs halt).

``--with-otlp`` and ``--with-sink`` add specproxy again in the same rotation, with ``--otlp-endpoint`` to a
receiver in this script, with ``--sink`` to a PostgreSQL it starts on the load side's CPUs (a database per
proxy), and with both when both are given (issue 35's case); each is printed as its per-round ratio to
specproxy without, against the targets, and for the sink the shipper thread's CPU per turn, its rows and
seconds behind, and the turns PostgreSQL holds against those the proxy recorded.

``--with-unmeasured`` adds specproxy again, sent the same requests on a path that is not a generation
endpoint (``UNMEASURED_PATH``; the upstream answers any path alike), which specproxy forwards and stores as
unmeasured rows: its CPU is forwarding and storing alone, and its per-round ratio to specproxy is what
measuring costs. It is checked to have recorded its turns, none of them measured.

This file is the orchestrator; beside it, ``overhead_peers.py`` holds the upstream and the load
generator (run as ``--role upstream`` / ``--role loadgen`` of this script), ``overhead_procs.py``
the processes (pinning, CPU from /proc, starting nginx and specproxy), ``overhead_sink.py`` the
PostgreSQL of ``--with-sink`` and what is read of the shipping, ``overhead_steps.py`` the timed steps of
``--loop-steps``, and ``overhead_tables.py`` the summaries and the tables it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the overhead_* modules and benchlib beside it
from benchlib import cpu_model, python_build
from overhead_peers import CHAT_PATH, loadgen_main, now_ns, otlp_receiver, raise_nofile, upstream_main, use_uvloop
from overhead_procs import (
    QUIET_WAITED,
    children,
    cpu_between,
    ensure_nginx,
    hwm_kb,
    listdir,
    machine_busy_s,
    pin,
    proc_cpu_s,
    proc_sched_s,
    procs_cpu_s,
    sleep_until,
    specproxy_state,
    start_nginx,
    start_specproxy,
    stop,
    thread_names,
    threads_cpu,
    wait_quiet,
    wake_floor,
)
from overhead_sink import SinkSide, delivered, shipper_sample, thread_on_cpu_s
from overhead_steps import render_steps
from overhead_tables import (BASELINE, OTLP_INTERVAL_S, UNMEASURED, UNMEASURED_PATH, WITH_OTLP, WITH_SINK, WITH_SINK_OTLP,
                             git_state, render, render_baseline, render_first_chunks, render_measuring, render_otlp,
                             render_polls, render_shipper, render_sink, render_targets, render_threads, summarize)
from overhead_watch import Watcher

ROOT = Path(__file__).resolve().parent.parent


def run_window(args, path: str, port: int, conns: int, pids: list[int], load_pids: list[int], load_cores, seed: int) -> dict:
    if getattr(args, "quiet_wait", 0) and getattr(args, "_our_pids", None):
        wait_quiet(args._our_pids, args.quiet_wait)
    t0 = now_ns() + int(0.35e9)  # the load generator's interpreter starts before t0
    t_start = t0 + int(args.warmup * 1e9)
    t_end = t_start + int(args.measure * 1e9)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "loadgen", "--port", str(port),
           "--conns", str(conns), "--t0", str(t0), "--t-start", str(t_start), "--t-end", str(t_end),
           "--tokens", f"{args.tokens[0]}-{args.tokens[1]}", "--prompt-bytes", str(args.prompt_bytes),
           "--stream-mode", args.stream_mode, "--seed", str(seed),
           "--request-path", UNMEASURED_PATH if path == UNMEASURED else CHAT_PATH]
    lg = subprocess.Popen(cmd, preexec_fn=pin(load_cores), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watcher = Watcher(port, t_end) if getattr(args, "watch", False) and path in ("specproxy", BASELINE) else None
    all_pids = lambda: [p for pid in pids for p in (pid, *children(pid))]  # noqa: E731
    sleep_until(t_start)
    proxy_pids = all_pids()
    m0 = machine_busy_s()
    c0 = sum(proc_cpu_s(p) for p in proxy_pids)
    s0 = sum(proc_sched_s(p) for p in proxy_pids)
    l0 = procs_cpu_s((*load_pids, lg.pid))
    th0 = {tid: v for p in proxy_pids for tid, v in threads_cpu(p).items()}
    w0 = now_ns()
    sleep_until(t_end)
    c1 = sum(proc_cpu_s(p) for p in proxy_pids)
    s1 = sum(proc_sched_s(p) for p in proxy_pids)
    l1 = procs_cpu_s((*load_pids, lg.pid))
    th1 = {tid: v for p in proxy_pids for tid, v in threads_cpu(p).items()}
    m1 = machine_busy_s()
    w1 = now_ns()
    out, err = lg.communicate(timeout=60)
    if lg.returncode != 0:
        raise RuntimeError(f"load generator failed: {err.decode()[-2000:]}")
    res = json.loads(out.decode().strip().splitlines()[-1])
    res["path"] = path
    res["conns"] = conns
    if watcher is not None:
        res["watch"] = watcher.join()
        w = res["watch"]
        print(f"  watched: {w['pictures']} live-page pictures ({w['events_bytes']} B of events), {w['scrapes']} "
              f"metrics scrapes, errors {w['errors'] or 'none'}", flush=True)
    res["proxy_cpu_s"] = c1 - c0 if pids else None
    res["cpu_us_per_chunk"] = (c1 - c0) / res["chunks"] * 1e6 if pids and res["chunks"] else None
    res["sched_us_per_chunk"] = (s1 - s0) / res["chunks"] * 1e6 if pids and res["chunks"] else None
    res["proxy_sched_s"] = s1 - s0 if pids else None
    load_s = cpu_between(l0, l1)
    res["load_cpu_util"] = load_s / ((w1 - w0) / 1e9) / max(1, len(load_cores or {0}))
    res["proxy_cpu_util"] = (c1 - c0) / ((w1 - w0) / 1e9) if pids else None
    # CPU used on this machine by anything but the benchmark's processes (other users, builds...)
    res["other_cpu_util"] = max(0.0, ((m1 - m0) - (c1 - c0) - load_s) / ((w1 - w0) / 1e9))
    if pids and res["chunks"]:
        res["threads"] = {
            str(tid): [(th1[tid][0] - th0[tid][0]) / res["chunks"] * 1e6, (th1[tid][1] - th0[tid][1]) / res["chunks"] * 1e6]
            for tid in th1 if tid in th0 and th1[tid][2] > th0[tid][2]  # it ran, whatever the ticks say
        }
        res["threads_on_cpu_s"] = {str(tid): th1[tid][2] - th0[tid][2] for tid in th1 if tid in th0}
    return res


CATEGORIES = (  # by the leaf frame of a sample on the event loop's thread
    ("event loop core (uvloop C: epoll, recv, send, callbacks, Task steps)", lambda f: f.startswith(("Runner.run ", "run_until_complete ", "run_forever "))),
    ("aiohttp server layers (request parsing, StreamResponse, keep-alive)", lambda f: any(x in f for x in ("web_protocol.py", "web_response.py", "web_request.py", "http_writer.py", "streams.py", "base_protocol.py", "aiohttp/helpers.py"))),
    ("specproxy per turn (handler, upstream request and head, hand-over to the relay thread)", lambda f: any(x in f for x in ("proxy.py", "exchange.py", "upstream.py", "pool.py", "relay.py", "relay_thread.py", "sockets.py", "http1.py", "service.py"))),
)


def steps_window(args, tmp: Path, up_port: int, c: int, proxy_cores, load_pids, load_cores) -> str:
    """One extra window (not in the tables) with a specproxy whose event-loop steps are timed
    (``overhead_steps.py``); the table of its turn, step by step."""
    out = tmp / f"loop-steps-{c}.json"
    runner = [sys.executable, str(Path(__file__).with_name("overhead_steps.py")), str(out)]
    proc, port, _ = start_specproxy(tmp, up_port, proxy_cores, args.specproxy_arg, runner)
    try:
        r = run_window(args, "specproxy", port, c, [proc.pid], load_pids, load_cores, seed=98)
    finally:
        stop(proc)  # its steps are written at exit
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        return f"loop steps: the instrumented specproxy wrote no {out.name} (its log is in {tmp})"
    return render_steps(data, c, r["sched_us_per_chunk"])


def profile_window(args, target: tuple[int, list[int]], c: int, load_pids, load_cores, out_path: str) -> str | None:
    """One extra window (not in the tables) with py-spy sampling specproxy: --gil --nonblocking, raw."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return "py-spy is not installed (pip install py-spy): no profile"
    port, pids = target
    names = thread_names(pids[0])
    dur = max(2, int(args.measure))
    delay = args.warmup + 0.45
    spy_cmd = [spy, "record", "--pid", str(pids[0]), "--rate", "250", "--gil", "--nonblocking", "--format", "raw",
               "--duration", str(dur), "-o", out_path]
    import threading

    def later() -> None:
        time.sleep(delay)
        subprocess.run(spy_cmd, preexec_fn=pin(load_cores), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    th = threading.Thread(target=later)
    th.start()
    r = run_window(args, "specproxy", port, c, pids, load_pids, load_cores, seed=99)
    th.join()
    try:
        lines = Path(out_path).read_text().splitlines()
    except OSError:
        return "py-spy produced no profile"
    by_cat: dict[str, int] = {}
    total = 0
    leaves: dict[str, int] = {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        n = int(n)
        total += n
        joined = ";".join(frames)
        if "MeasuringWorker" in joined:
            cat = "measuring thread (build_record: framing, SSE, JSON, tiktoken)"
        elif "Writer._run" in joined:
            cat = "SQLite writer thread"
        else:
            leaf = frames[-1]
            cat = next((name for name, match in CATEGORIES if match(leaf)),
                       "other work on the event loop")
        by_cat[cat] = by_cat.get(cat, 0) + n
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
    L = [f"py-spy (--gil --nonblocking, 250 Hz) on specproxy at C={c}, one extra window "
         f"({r['cpu_us_per_chunk'] or 0:.1f} µs/chunk, raw profile in {out_path}): share of the samples in which a "
         "thread held the GIL (Python and the C it calls; idle waits are not counted)", "",
         "| where | share |", "|---|---:|"]
    for cat, n in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        L.append(f"| {cat} | {100 * n / total:.0f}% |")
    L += ["", "Top leaf frames:", "", "| frame | share |", "|---|---:|"]
    for leaf, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:12]:
        L.append(f"| `{leaf}` | {100 * n / total:.1f}% |")
    del names
    return "\n".join(L)


def orchestrate(args) -> None:
    raise_nofile()
    meta_cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]])
    t_begin = time.monotonic()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        proxy_cores, load_cores = {cores[-1]}, set(cores[:-1])
    else:
        proxy_cores, load_cores = None, None
        print("only one CPU: nothing is pinned, the proxy shares the CPU with the load", file=sys.stderr)
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    wake = wake_floor(min(load_cores), min(proxy_cores)) if proxy_cores else (float("nan"),) * 3
    print(f"cross-CPU wake-up latency: p50 {wake[0]:.0f} µs, p99 {wake[1]:.0f} µs, max {wake[2]:.0f} µs", file=sys.stderr)
    paths = ["direct", "nginx", "specproxy"]
    nginx_bin = None if args.no_nginx else ensure_nginx()
    if nginx_bin is None:
        paths.remove("nginx")
    receiver = sink = None
    variant_args: dict[str, object] = {}  # specproxy again in the same rotation: each variant's extra arguments
    if args.with_otlp:  # pushing OTLP to a local receiver
        otlp_url, otlp_took, receiver = otlp_receiver()
        otlp_args = ["--otlp-endpoint", otlp_url, "--otlp-interval", str(OTLP_INTERVAL_S)]
        variant_args[WITH_OTLP] = lambda: otlp_args
    if args.with_sink:  # shipping to a local PostgreSQL (on the load side's CPUs: this process's now)
        sink = SinkSide()
        variant_args[WITH_SINK] = lambda: ["--sink", sink.new_url()]
        if args.with_otlp:
            variant_args[WITH_SINK_OTLP] = lambda: ["--sink", sink.new_url(), *otlp_args]
    if args.with_unmeasured:  # the same specproxy, asked on a path it forwards unmeasured (run_window)
        variant_args[UNMEASURED] = lambda: []
    paths += list(variant_args)
    deliveries: dict[str, dict[str, dict]] = {}  # --with-sink: per C and path, the turns and the shipper's life
    nginx_version = "-"
    if nginx_bin:
        v = subprocess.run([nginx_bin, "-v"], capture_output=True, text=True)
        nginx_version = (v.stderr or v.stdout).strip().split("/")[-1]
    base_python = base_git = None
    if args.specproxy_baseline:  # another checkout's specproxy (its own venv) in the same rotation
        base_root = Path(args.specproxy_baseline).resolve()
        base_python = str(base_root / ".venv" / "bin" / "python")
        if not os.path.exists(base_python):
            sys.exit(f"--specproxy-baseline: no {base_python} (make the checkout's venv: pip install -e .)")
        paths.append(BASELINE)
        base_git = f"{git_state(base_root)}, Python {python_build(base_python)}"
    cs = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    env_cores = ",".join(map(str, sorted(load_cores))) if load_cores else "any"
    up = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", "upstream",
                           "--step-ms", str(args.step_ms)], preexec_fn=pin(load_cores), stdout=subprocess.PIPE)
    runs: list[dict] = []
    held: dict[int, bool] = {}
    polls: dict[int, dict[str, float]] = {}  # specproxy's cadence poll per C, from its state line
    profile_c = 256 if 256 in cs else max(cs)
    profile = steps = None
    try:
        up_port = int(up.stdout.readline())
        for c in cs:
            nginx = specproxy = None
            variants: dict[str, tuple[subprocess.Popen, int, Path, str | None]] = {}  # proc, port, db, sink URL
            try:
                targets = {"direct": (up_port, [])}
                if "nginx" in paths:
                    nginx, nport = start_nginx(nginx_bin, tmp, up_port, proxy_cores)
                    targets["nginx"] = (nport, [nginx.pid])
                specproxy, sport, db = start_specproxy(tmp, up_port, proxy_cores, args.specproxy_arg)
                targets["specproxy"] = (sport, [specproxy.pid])
                for path, extra_of in variant_args.items():
                    extra = extra_of()
                    vproc, vport, vdb = start_specproxy(tmp, up_port, proxy_cores, [*args.specproxy_arg, *extra])
                    variants[path] = (vproc, vport, vdb, extra[1] if extra[:1] == ["--sink"] else None)
                    targets[path] = (vport, [vproc.pid])
                if base_python is not None:  # the other checkout's specproxy, by its own interpreter
                    bproc, bport, bdb = start_specproxy(tmp, up_port, proxy_cores, args.specproxy_arg, base_python)
                    variants[BASELINE] = (bproc, bport, bdb, None)
                    targets[BASELINE] = (bport, [bproc.pid])
                state0, t_state0 = specproxy_state(specproxy, tmp, sport), time.monotonic()
                args._our_pids = ([os.getpid(), up.pid] + [t[1][0] for t in targets.values() if t[1]]
                                  + ([sink.server.pid] if sink else []))
                for rnd in range(args.rounds):
                    order = paths[rnd % len(paths):] + paths[: rnd % len(paths)]
                    for p in order:
                        port, pids = targets[p]
                        load_pids = [up.pid, *(sink.pids() if sink else [])]  # PostgreSQL: the load side's
                        r = run_window(args, p, port, c, pids, load_pids, load_cores, seed=rnd * 7 + 1)
                        r["round"] = rnd
                        if p in variants and variants[p][3]:  # the shipper's gauges, just after the window
                            r["shipper"] = shipper_sample(specproxy_state(variants[p][0], tmp, port))
                        runs.append(r)
                        print(f"C={c:<4} round {rnd + 1}/{args.rounds} {p:9}: {r['chunks_per_s']:9.0f} chunks/s "
                              f"p50 {r['lat_us'].get('p50', float('nan')):8.0f} µs  p99 {r['lat_us'].get('p99', float('nan')):8.0f} µs"
                              + (f"  cpu {r['cpu_us_per_chunk']:6.1f} (stat) {r['sched_us_per_chunk']:6.1f} (schedstat) µs/chunk, {r['proxy_cpu_util']:.2f} cores" if r["cpu_us_per_chunk"] is not None else "")
                              + f"  load side {r['load_cpu_util']:.2f} cores"
                              + (f"  errors {r['errors']} {r['error_kinds']}" if r["errors"] else ""),
                              file=sys.stderr, flush=True)
                state1 = specproxy_state(specproxy, tmp, sport)
                if state0 and state1 and "poll_windows" in state1:
                    polls[c] = {k: state1[k] - state0[k] for k in ("poll_windows", "poll_hits", "poll_s")}
                    polls[c]["cores"] = polls[c]["poll_s"] / (time.monotonic() - t_state0)
                for path, (vproc, _, vdb, url) in variants.items():
                    if url:  # every turn it recorded reached PostgreSQL? (waits, bounded, for the drain)
                        d = deliveries.setdefault(str(c), {})[path] = delivered(vdb, url)
                        d["ship_cpu_s"] = thread_on_cpu_s(vproc.pid)
                        d["completed"] = sum(r.get("turns_all", 0) for r in runs
                                             if r["conns"] == c and r["path"] == path)
                        print(f"C={c}: {path}: the load generator completed {d['completed']} turns, specproxy "
                              f"recorded {d['recorded']} ({d['recorded_ok']} ok), PostgreSQL holds {d['in_pg']} "
                              f"({d['in_pg_ok']} ok) after waiting {d['waited_s']:.1f} s for the shipper",
                              file=sys.stderr)
                procs = {"specproxy": specproxy, **{path: v[0] for path, v in variants.items()}}
                names = {path: {**thread_names(proc.pid), **{int(t): "measuring process" for ch in children(proc.pid)
                                                                for t in listdir(f"/proc/{ch}/task")}}
                         for path, proc in procs.items()}
                names["nginx"] = {nginx.pid: "master", **{k: "worker" for k in children(nginx.pid)}} if nginx else {}
                if c == profile_c and args.py_spy:
                    profile = profile_window(args, targets["specproxy"], c, [up.pid], load_cores, args.py_spy)
                if c == profile_c and args.loop_steps:
                    steps = steps_window(args, tmp, up_port, c, proxy_cores, [up.pid], load_cores)
                hwm = {"nginx": sum(hwm_kb(p) for p in ([nginx.pid, *children(nginx.pid)] if nginx else [])),
                       **{path: sum(hwm_kb(p) for p in (proc.pid, *children(proc.pid)))
                          for path, proc in procs.items()}}
                for r in runs:
                    if r["conns"] == c and r["path"] in names and "threads" in r:
                        r["thread_names"] = {tid: names[r["path"]].get(int(tid), f"tid {tid}") for tid in r["threads"]}
                for r in runs:
                    if r["conns"] == c and r["path"] in hwm:
                        r["rss_kb"] = hwm[r["path"]]
                nominal = c * 1000.0 / args.step_ms * (args.tokens[0] + args.tokens[1]) / (args.tokens[0] + args.tokens[1] + 2)
                directs = [r["chunks_per_s"] for r in runs if r["conns"] == c and r["path"] == "direct"]
                held[c] = bool(directs) and statistics.median(directs) >= 0.9 * nominal
            finally:
                stop(specproxy)
                stop(nginx)
                for vproc, *_ in variants.values():
                    stop(vproc)
            if specproxy is not None:
                import sqlite3

                try:
                    n = sqlite3.connect(db).execute("SELECT count(*), sum(outcome = 'ok') FROM turns").fetchone()
                    print(f"C={c}: specproxy recorded {n[0]} turns ({n[1]} ok) in {db.name}", file=sys.stderr)
                except sqlite3.Error as exc:
                    print(f"C={c}: cannot read specproxy's database: {exc}", file=sys.stderr)
            if UNMEASURED in variants:  # its figures are forwarding's alone only if it measured nothing
                n, measured = unmeasured_rows(variants[UNMEASURED][2])
                if not n or measured:
                    raise RuntimeError(f"C={c}: {UNMEASURED} recorded {n} turns, {measured} of them measured: "
                                       "not the unmeasured path it is meant to be")
                print(f"C={c}: {UNMEASURED} recorded {n} turns, none measured", file=sys.stderr)
    finally:
        stop(up)
        if receiver is not None:
            receiver.shutdown()
        if sink is not None:
            sink.close()
    summary = summarize(runs, cs, paths)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(), "cpu": cpu_model(), "command": meta_cmd,
        "stream_mode": args.stream_mode, "step_ms": args.step_ms, "tokens": args.tokens,
        "prompt_bytes": args.prompt_bytes, "rounds": args.rounds, "warmup": args.warmup, "measure": args.measure,
        "proxy_cores": ",".join(map(str, sorted(proxy_cores))) if proxy_cores else "any", "load_cores": env_cores,
        "nginx_version": nginx_version, "wake": wake, "git": git_state(), "python": python_build(),
        "cadence_poll": polls, "sink": deliveries, "baseline_git": base_git,
    }
    print()
    print(render(summary, cs, paths, meta, held))
    first = render_first_chunks(summary, cs, paths)
    if first is not None:
        print()
        print(first)
    print()
    print(render_targets(summary, cs))
    print()
    for path in (WITH_SINK_OTLP, WITH_SINK):  # issue 35: the targets with a sink (and OTLP) on
        if path in paths:
            print(render_targets(summary, cs, path))
            print()
            break
    for c in cs:  # where each C's CPU goes, C=256 (the targets') included
        if c > 1 or len(cs) == 1:  # at C=1 a window holds ~200 chunks: per-thread splits are noise
            print(render_threads(runs, c))
            print()
    if polls:
        print(render_polls(polls))
        print()
    if receiver is not None:
        print(render_otlp(runs, cs, otlp_took[0]))
        print()
    if sink is not None:
        print(render_sink(runs, cs))
        print()
        print(render_shipper(runs, cs, deliveries))
    if UNMEASURED in paths:
        print(render_measuring(runs, cs))
        print()
    if base_git is not None:
        print(render_baseline(runs, cs, base_git))
        print()
    if profile:
        print(profile)
    if steps:
        print()
        print(steps)
        print()
    loads = [r["load_cpu_util"] for r in runs]
    others = [r["other_cpu_util"] for r in runs]
    print(f"Load side (upstream + load generator{' + PostgreSQL' if sink else ''}) used at most {max(loads):.2f} of its "
          f"{len(load_cores or [0])} CPU(s) in any window; errors in all windows: {sum(r['errors'] for r in runs)}; "
          f"total time {time.monotonic() - t_begin:.0f} s. CPU used by other processes on this machine during the "
          f"windows: median {statistics.median(others):.2f}, max {max(others):.2f} cores"
          + (" -- NOT a quiet machine: rerun when it is" if max(others) > 0.15 else " (quiet)")
          + f"; waited {QUIET_WAITED[0]:.0f} s in all for other processes to go quiet.")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


def unmeasured_rows(db: Path) -> tuple[int, int]:
    """The turns a specproxy recorded in ``db``, and how many of them it measured."""
    import sqlite3

    con = sqlite3.connect(db)
    try:
        n, measured = con.execute("SELECT count(*), coalesce(sum(measured), 0) FROM turns").fetchone()
    finally:
        con.close()
    return n, measured


def _tokens(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64,256,512", help="comma-separated C values [1,64,256,512]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds before each measured window [1.5]")
    ap.add_argument("--measure", type=float, default=4.0, help="seconds measured per window [4]")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the upstream's decode step period [20 ms]")
    ap.add_argument("--stream-mode", choices=("batched", "smooth"), default="batched")
    ap.add_argument("--tokens", type=_tokens, default=(50, 150), help="chunks per turn, LO-HI [50-150]")
    ap.add_argument("--prompt-bytes", type=int, default=4000, help="size of each request's system prompt [4000]")
    ap.add_argument("--no-nginx", action="store_true", help="skip the nginx baseline")
    ap.add_argument("--watch", action="store_true", help="during specproxy's windows, read its live page's event "
                    "stream and scrape its /_specproxy/metrics every second (its cost is then in the figures)")
    ap.add_argument("--specproxy-arg", action="append", default=[], help="extra argument for specproxy serve")
    ap.add_argument("--with-otlp", action="store_true", help="also run specproxy with --otlp-endpoint to a local "
                    "receiver in the same rotation, and print the with/without ratios")
    ap.add_argument("--with-sink", action="store_true", help="also run specproxy with --sink to a PostgreSQL this "
                    "script starts (and, with --with-otlp, one with both) in the same rotation; print the with/without "
                    "ratios, the shipper's CPU per turn and lag, and the turns PostgreSQL holds")
    ap.add_argument("--with-unmeasured", action="store_true", help="also run specproxy sent the same streams on a "
                    "path it forwards without measuring, in the same rotation, and print the measured / unmeasured "
                    "ratios: measuring's share of its CPU")
    ap.add_argument("--specproxy-baseline", metavar="CHECKOUT", help="also run the specproxy of another checkout "
                    "(its .venv, made with pip install -e .) in the same rotation, and print this / that ratios per "
                    "round: a before/after on one machine in one run")
    ap.add_argument("--json", help="write every window's raw numbers here")
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="before each window wait until other processes "
                    "use < 0.15 CPU, at most this many seconds in all [60]; 0: never wait")
    ap.add_argument("--loop-steps", action="store_true", help="add one window at C=256 with specproxy's event-loop "
                    "steps timed on its thread (scripts/overhead_steps.py) and print its turn step by step")
    ap.add_argument("--py-spy", metavar="PATH", help="add one window at C=256 with py-spy sampling specproxy; "
                    "raw profile to PATH, summary printed")
    # internal roles
    ap.add_argument("--role", choices=("orchestrate", "upstream", "loadgen"), default="orchestrate", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t-start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t-end", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--request-path", default=CHAT_PATH, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "orchestrate":
        sys.path.insert(0, str(ROOT))
        orchestrate(args)
        return
    raise_nofile()
    use_uvloop()
    asyncio.run(upstream_main(args) if args.role == "upstream" else loadgen_main(args))


if __name__ == "__main__":
    main()
