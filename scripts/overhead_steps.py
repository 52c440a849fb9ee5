"""The event loop's turn, step by step: ``bench_overhead.py --loop-steps``.

Why: the event loop spends about as much CPU per turn as measuring does, spread over many small steps,
and a sampling profiler run beside the proxy either inflates the small calls (cProfile) or blurs them
(py-spy). This times each synchronous step of a turn on the loop's own thread with ``thread_time``, in
the proxy under load, where each step costs several times what it costs warm in a loop of its own.

How: run as the interpreter of ``specproxy serve`` (``python overhead_steps.py OUT -m specproxy.app.cli
serve ...``), it wraps the steps in ``STEPS`` (on the main thread only; other threads call through),
runs the module and writes ``OUT`` (JSON) at exit: each step's nanoseconds and calls, the turns ended
(``Exchange.end``), and the loop thread's CPU from the first step to the latest turn's end. The
wrappers cost a little themselves (two clock reads a call): the window's CPU per chunk against
specproxy's own in the same run says how much.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import threading
import time

from benchlib import owner_of

__all__ = ["STEPS", "render_steps"]

# (module, attribute path, what the step is, the step it runs inside or None): the top-level steps are
# each called from the loop (a callback or a coroutine's synchronous part), never inside one another
STEPS = (
    ("specproxy.serve.lane", "Lane.data_received", "the request read from the client, the exchange's task made", None),
    ("specproxy.serve.lane", "read_head", "its head checked", "Lane.data_received"),
    ("specproxy.measure.turn_recorder", "TurnRecorder.__init__", "the turn's recorder made", None),
    ("specproxy.serve.proxy", "request_head", "the upstream request's head made", None),
    ("specproxy.wire.pool", "UpstreamPool.checkout", "a connection checked out", None),
    ("specproxy.wire.upstream", "UpstreamConn.send", "the request written upstream", None),
    ("specproxy.wire.upstream", "UpstreamConn.data_received", "the response head read and parsed", None),
    ("specproxy.serve.proxy", "response_head", "the client's head made", None),
    ("specproxy.wire.exchange", "Exchange.attach", "the body handed to the relay thread", None),
    ("specproxy.wire.relay_thread", "ThreadRelay.start", "the thread's turn started", "Exchange.attach"),
    ("specproxy.wire.exchange", "taken", "the client's progress read from TCP_INFO", "Exchange.attach"),
    ("specproxy.wire.relay_thread", "TurnSink._collect", "the thread's ends heard", None),
    ("specproxy.wire.exchange", "Exchange.end", "the exchange ended, its connection checked in", "TurnSink._collect"),
    ("specproxy.serve.proxy", "Proxy._submit", "the turn handed to measuring", None),
    ("specproxy.serve.proxy", "Proxy._built", "built records heard by /metrics and the live page", None),
    ("specproxy.serve.own_metrics", "OwnMetrics.record", "the /metrics histograms", "Proxy._built"),
    ("specproxy.serve.lane", "Lane._next", "the connection's next request awaited", None),
)
TURN_END = "Exchange.end"


def _install(out: str) -> None:
    """Wrap every step; write ``out`` at exit."""
    main = threading.main_thread().ident
    spent: dict[str, list[int]] = {}
    marks = {"first": None, "last": None}

    for module, path, _, _ in STEPS:
        owner, name = owner_of(module, path)
        spent[path] = [0, 0]
        setattr(owner, name, _timed(getattr(owner, name), spent[path], main, marks, path == TURN_END))

    def write() -> None:
        with open(out, "w") as f:
            json.dump({"steps": spent, "cpu_ns": (marks["last"] or 0) - (marks["first"] or 0)}, f)

    atexit.register(write)


def _timed(fn, acc: list[int], main: int, marks: dict, turn_end: bool):
    def timed(*args, **kwargs):
        if threading.get_ident() != main:
            return fn(*args, **kwargs)
        t0 = time.thread_time_ns()
        if marks["first"] is None:
            marks["first"] = t0
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.thread_time_ns()
            acc[0] += t1 - t0
            acc[1] += 1
            if turn_end:
                marks["last"] = t1

    timed.__wrapped__ = fn
    return timed


def render_steps(data: dict, c: int, cpu_us_per_chunk: float | None) -> str:
    """The table ``bench_overhead.py --loop-steps`` prints: µs of the loop's CPU per turn, by step."""
    steps = data["steps"]
    turns = steps[TURN_END][1]
    if not turns:
        return "loop steps: no turn ended in the window"
    per = {path: (ns / turns / 1e3, calls / turns) for path, (ns, calls) in steps.items()}
    cpu = data["cpu_ns"] / turns / 1e3
    top = sum(per[path][0] for _, path, _, parent in STEPS if parent is None)
    shown = f", {cpu_us_per_chunk:.1f} µs/chunk in all its threads" if cpu_us_per_chunk is not None else ""
    L = [f"The event loop's turn, step by step, at C={c} (one extra window{shown}; specproxy run under "
         "scripts/overhead_steps.py: its thread's CPU in µs per turn, each step timed with thread_time, the "
         f"wrappers' own cost included; {turns:,} turns):", "",
         "| step | µs per turn | calls per turn |", "|---|---:|---:|"]
    for _, path, what, parent in STEPS:
        us, calls = per[path]
        label = f"… of which {what} (`{path}`)" if parent else f"{what} (`{path}`)"
        L.append(f"| {label} | {us:.1f} | {calls:.2f} |")
    L.append(f"| the steps above | {top:.0f} | |")
    L.append(f"| the rest: the task's steps between them, uvloop's callbacks and timers, system calls | "
             f"{cpu - top:.0f} | |")
    L.append(f"| **the loop's thread, all** | **{cpu:.0f}** | |")
    return "\n".join(L)


def main() -> None:
    out, dash_m, module, *rest = sys.argv[1:]
    if dash_m != "-m":
        sys.exit("usage: overhead_steps.py OUT -m MODULE [ARG ...]")
    _install(out)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
