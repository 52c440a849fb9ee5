"""What measuring one streamed turn costs per chunk: ``build_record`` and its parts, in one run.

    python scripts/bench_measure.py                   # 40 turns x 100 chunks, 7 repeats (~5 s)
    python scripts/bench_measure.py --turns 100 --repeats 15
    python scripts/bench_measure.py --beside-relay    # also the build sharing its CPU with loopback relaying
    python scripts/bench_measure.py --phases          # also each phase of the build, in µs per turn
    python scripts/bench_measure.py --baseline ../before --pairs 5   # the same turns built by another checkout

The turns are what the proxy sees relaying an OpenAI-compatible engine: HTTP/1.1 chunked framing kept
verbatim, one frame per read (one chunk per decode step), ``chat.completion.chunk`` JSON with id,
object, created, model, system_fingerprint and one choice ``{index, delta, logprobs, finish_reason}``
(a role chunk, ~100 content chunks of one token each, cut from real text by the tokenizer, a final
chunk with finish_reason and usage, ``[DONE]``, the last-chunk frame). Two shapes: ``plain``, and
``t_send``, whose chunks end with a field ``"t_send": <ns>`` that changes every chunk (what
``scripts/bench_overhead.py``'s upstream sends). The request has a ~4000-byte system prompt and one
of 8 user messages (8 conversations: each build compares a turn with its session's previous one, as the
measuring thread does); the tokenizer is ``tiktoken:o200k_base``, loaded as the proxy loads it.

Printed, in µs per chunk (an SSE event read; median over the repeats of the mean over all turns, with
the range of the repeats): ``build`` (what the proxy runs: the framing joined and the stream read by
the chat stream's native reader, ``specproxy.frames._scanc``, where built), its parts (``C join +
native read``, and the rest: request parse, token counting, the Record), the reference build
(``build_record(turn, tok, fast=False)``) and the reference's parts (``dechunk``, ``reference stream_texts``), measured in
the same run. Every figure is the timing thread's CPU time (``time.thread_time``), not the wall clock.

``--beside-relay`` times the build again, alternating with the build alone, beside a process on the same
CPU that relays small messages over 64 loopback TCP connections in bursts (``RELAY_BESIDE``), paused
while the build runs alone: what sharing a CPU with kernel networking costs the same Python (the relay
thread runs beside the measuring thread when the proxy has one CPU, as ``scripts/bench_overhead.py``
pins it). Printed as the median over the pairs of beside / alone.

``--phases`` times each phase of the build in µs per turn (``measure_phases.py``: the request parsed, the
response read and its parts, the completion and the prompt counted, the prefix tracker, the Record...),
with the build's whole time with and without the wrappers that time them.

``--baseline CHECKOUT`` builds the same turns with another checkout's package, by that checkout's
``.venv/bin/python`` (``measure_vs.py`` on each side, in alternating order, ``--pairs`` times): the
median over the pairs of this / that build, per shape. Both sides compare each turn with its session's
previous one (``PrefixTracker``), as the proxy's measuring thread does. A checkout from before issue 33
(whose recorder built its own Record) is built through its own API.

The machine may be noisy: compare ratios within one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from itertools import accumulate
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import cpu_model, python_build  # the machine line every benchmark script prints
from measure_phases import phases_table
from measure_turns import READS, make_turns

from specproxy.frames import chunked
from specproxy.measure import fast_texts, texts
from specproxy.measure.apis import CHAT
from specproxy.measure.build import build_record
from specproxy.measure.prefix import PrefixTracker
from specproxy.measure.tokens import load_tokenizer
from specproxy.measure.turn_recorder import TurnRecorder

def time_reference_parts(turns: list[TurnRecorder]) -> dict[str, float]:
    """Seconds over all turns to dechunk, and to parse the stream, by the references."""
    t0 = time.thread_time()
    payloads = [chunked.dechunk_reads(b.reads) for b in turns]
    t1 = time.thread_time()
    for b, p in zip(turns, payloads):
        texts.stream_texts_reference(p, b.read_times)
    t2 = time.thread_time()
    return {"dechunk": t1 - t0, "reference stream_texts": t2 - t1}


def time_native(turns: list[TurnRecorder]) -> float:
    """Seconds over all turns for the build's reading of the stream: the frames joined in C and the chat
    stream read as ``build_record`` reads it (``Api.read_stream``)."""
    t0 = time.thread_time()
    for b in turns:
        joined = chunked.join_reads(list(b.reads), True)  # (a copy: the join consumes its list)
        if joined is None:  # not built: the Python reference's join, then the reference read
            reads = chunked.dechunk_reads(b.reads)
            joined = b"".join(reads), list(accumulate(map(len, reads))), True
        CHAT.read_stream(joined[0], joined[1], b.read_times)
    return time.thread_time() - t0


def time_builds(turns: list[TurnRecorder], tok, fast: bool) -> float:
    """Seconds over all turns for their builds, each of the whole turn as the measuring thread builds it
    (each compared with its session's previous turn: ``PrefixTracker``): the build consumes its turn's
    reads (``build_record`` lets go of each as it joins them), so each gets them back first, untimed."""
    took = 0.0
    prefixes = PrefixTracker()
    for b in turns:
        b.reads = list(READS[id(b)])
        t0 = time.thread_time()
        build_record(b, tok, fast=fast, prefixes=prefixes)
        took += time.thread_time() - t0
    return took


RELAY_BESIDE = r"""
import socket, sys, time
pairs = []
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
for _ in range(64):
    c = socket.create_connection(server.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    d, _ = server.accept()
    pairs.append((c, d))
msg = b"x" * 300
print("ready", flush=True)
while True:  # a burst: one message through each connection, as a decoding step's chunks; then a pause
    for c, d in pairs:
        c.send(msg)
        d.recv(4096)
    time.sleep(0.002)
"""


class _RelayBeside:
    """A process on this process's CPU relaying small messages over loopback TCP in bursts (see the
    module's docstring); ``share()`` is the CPU it took since the last call."""

    def __init__(self, cpu: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RELAY_BESIDE], stdout=subprocess.PIPE,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        self.proc.stdout.readline()  # "ready"
        self._mark = self._cpu()

    def _cpu(self) -> tuple[float, float]:
        on_cpu_ns = int(Path(f"/proc/{self.proc.pid}/schedstat").read_text().split()[0])  # ns, not 10 ms ticks
        return on_cpu_ns / 1e9, time.monotonic()

    def share(self) -> float:
        (cpu0, t0), (cpu1, t1) = self._mark, self._cpu()
        self._mark = (cpu1, t1)
        return (cpu1 - cpu0) / (t1 - t0)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def same_records(b: TurnRecorder, tok) -> bool:
    ref = build_record(b, tok, fast=False)  # first: the reference reads a copy, the build consumes the reads
    fast = build_record(b, tok, fast=True)
    b.reads = list(READS[id(b)])
    return all(getattr(fast, f) == getattr(ref, f) for f in fast.__dataclass_fields__ if f != "id")


def run(args) -> None:
    tok = load_tokenizer("tiktoken:o200k_base")
    cpu = max(os.sched_getaffinity(0))
    if args.beside_relay:  # the build and its neighbour on one CPU, as in the proxy under bench_overhead
        os.sched_setaffinity(0, {cpu})
    print(f"# {cpu_model()}, Python {python_build()}; {args.turns} turns x {args.chunks} chunks, "
          f"{args.repeats} repeats; µs per chunk: median of the repeats [their range]; C scans "
          f"{'built' if fast_texts.C_BUILT else 'NOT built (build is the reference)'}")
    for shape in ("plain", "t_send"):
        turns = make_turns(tok, args.turns, args.chunks, shape == "t_send")
        nchunks = sum(len(b.reads) - 1 for b in turns)  # every read but the last-chunk frame is an event
        assert all(same_records(b, tok) for b in turns)  # the tests prove it; a cheap check of the setup
        samples: dict[str, list[float]] = {}
        for _ in range(args.repeats + 1):  # the first is a warm-up
            gc.collect()
            gc.disable()
            try:
                rep = {"build": time_builds(turns, tok, True), "reference build": time_builds(turns, tok, False),
                       "C join + native read": time_native(turns), **time_reference_parts(turns)}
            finally:
                gc.enable()
            for k, v in rep.items():
                samples.setdefault(k, []).append(v / nchunks * 1e6)
        for v in samples.values():
            del v[0]
        med = {k: statistics.median(v) for k, v in samples.items()}
        med["rest of build"] = med["build"] - med["C join + native read"]
        rows = ["build", "C join + native read", "rest of build", "reference build", "dechunk", "reference stream_texts"]
        print(f"\n## {shape}: {nchunks} chunks")
        for k in rows:
            spread = f"[{min(samples[k]):6.3f} .. {max(samples[k]):6.3f}]" if k in samples else " " * 18
            ratio = f"  {med[k] / med['reference build']:4.2f}x the reference build" if "build" in k else ""
            print(f"{k:>34}: {med[k]:7.3f}  {spread}{ratio}")
        if args.phases:
            print(phases_table(turns, tok, time_builds, args.repeats))
        if args.beside_relay:
            beside_relay(turns, tok, nchunks, cpu, args.repeats)


def beside_relay(turns: list[TurnRecorder], tok, nchunks: int, cpu: int, repeats: int) -> None:
    """The build alone and beside a loopback relay on its CPU, alternating (the relay paused between), so
    that both see the machine alike: the median over the pairs of the ratio beside / alone."""
    beside = _RelayBeside(cpu)
    alone, near, shares = [], [], []
    try:
        for _ in range(repeats + 1):  # the first pair is a warm-up
            beside.pause()
            alone.append(time_builds(turns, tok, True) / nchunks * 1e6)
            beside.resume()
            beside.share()
            near.append(time_builds(turns, tok, True) / nchunks * 1e6)
            shares.append(beside.share())
    finally:
        beside.stop()
    ratios = [b / a for a, b in zip(alone[1:], near[1:])]
    print(f"{'build beside a loopback relay':>34}: {statistics.median(near[1:]):7.3f}  "
          f"[{min(near[1:]):6.3f} .. {max(near[1:]):6.3f}]  {statistics.median(ratios):4.2f}x the build alone "
          f"in the same pairs [{min(ratios):4.2f} .. {max(ratios):4.2f}] (the relay took "
          f"{statistics.median(shares[1:]):.2f} of CPU {cpu})")


def versus(args) -> None:
    """``--baseline``: this checkout's build and the baseline's, of the same turns, in alternating pairs."""
    other = Path(args.baseline).resolve() / ".venv" / "bin" / "python"
    if not other.exists():
        sys.exit(f"--baseline: no {other} (make the checkout's venv: pip install -e .)")
    worker = [str(ROOT / "scripts" / "measure_vs.py"), str(args.turns), str(args.chunks), str(args.repeats)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # each side imports its own package

    def side(python: str) -> dict[str, float]:
        done = subprocess.run([python, *worker], capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"--baseline: {python} failed: {done.stderr.strip().splitlines()[-1:]}")
        return json.loads(done.stdout)

    sides = {"this": [], "baseline": []}
    for i in range(args.pairs):
        order = (("this", sys.executable), ("baseline", str(other)))
        for name, python in order if i % 2 == 0 else order[::-1]:
            sides[name].append(side(python))
            print(f"pair {i + 1}/{args.pairs} {name:8}: " + ", ".join(f"{k} {v:.3f}" for k, v in sides[name][-1].items())
                  + " µs per chunk", file=sys.stderr, flush=True)
    print(f"# {cpu_model()}, Python {python_build()}; {args.turns} turns x {args.chunks} chunks, {args.repeats} "
          f"repeats a side, {args.pairs} alternating pairs; baseline {args.baseline} ({python_build(str(other))})")
    print("\n| shape | this µs/chunk | baseline µs/chunk | this / baseline (median of the pairs, min–max) |")
    print("|---|---:|---:|---:|")
    for shape in sides["this"][0]:
        a = [p[shape] for p in sides["this"]]
        b = [p[shape] for p in sides["baseline"]]
        r = [x / y for x, y in zip(a, b)]
        print(f"| {shape} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
              f"{statistics.median(r):.3f} ({min(r):.3f}–{max(r):.3f}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--chunks", type=int, default=100, help="content chunks per turn")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--phases", action="store_true", help="also time each phase of the build, in µs per turn")
    p.add_argument("--beside-relay", action="store_true",
                   help="also time the build sharing its CPU with a process relaying over loopback TCP")
    p.add_argument("--baseline", metavar="CHECKOUT", help="instead, build the same turns with another checkout's "
                   "package (its .venv) and this one's, in alternating pairs, and print this / that")
    p.add_argument("--pairs", type=int, default=5, help="with --baseline: the alternating pairs [5]")
    args = p.parse_args()
    versus(args) if args.baseline else run(args)


if __name__ == "__main__":
    main()
