"""What measuring one streamed turn costs per chunk: ``build_record`` and its parts, in one run.

    python scripts/bench_measure.py                   # 40 turns x 100 chunks, 7 repeats (~5 s)
    python scripts/bench_measure.py --turns 100 --repeats 15
    python scripts/bench_measure.py --beside-relay    # also the build sharing its CPU with loopback relaying
    python scripts/bench_measure.py --phases          # also each phase of the build, in µs per turn

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

The machine may be noisy: compare ratios within one run, not numbers across runs; for a
before/after, run this script of each checkout in turn, alternating, several times.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from itertools import accumulate
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import cpu_model, python_build  # the machine line every benchmark script prints
from measure_phases import phases_table

from specproxy.frames import chunked
from specproxy.measure import fast_texts, texts
from specproxy.measure.apis import CHAT
from specproxy.measure.build import build_record
from specproxy.measure.prefix import PrefixTracker
from specproxy.measure.tokens import load_tokenizer
from specproxy.measure.turn_recorder import TurnRecorder

PROSE = """\
Speculative decoding speeds up inference by letting a small draft model propose several tokens that the
large model then verifies in one forward pass. When the draft is right, the server emits more than one
token per step; when it is wrong, it falls back to a single token. The effect on latency depends on the
acceptance rate, which varies with the kind of text: code and structured output are often predictable,
while creative writing is not.

To measure it honestly you need the time each token reached the client, not just the total. A proxy in
front of the server can stamp every read as it crosses the socket, then count tokens with the model's own
tokenizer once the turn is over. The résumé of the results: first-token latency, decode rate, tokens per
chunk — and whether the speed-up you paid for is real. Ça dépend du modèle, naturellement.

Here is a short list:
- "draft" acceptance: 62%
- tokens/s: 48.5 → 91.2
- 日本語のテキストも同じように数えられます。
"""

HEAD = (
    b'{"id":"chatcmpl-5f0c8e2a9b7d4c1e8a6f3b2d1c0e9f8a","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","system_fingerprint":"fp_bench","choices":[{"index":0,'
)
SYSTEM = ("You are a careful assistant. Answer briefly and cite the measurement you rely on. " * 60)[:4000]


def _event(choice_rest: bytes, t_send: int | None, extra: bytes = b"") -> bytes:
    """``data: {...,"choices":[{"index":0,<choice_rest>]<extra>[,"t_send":N]}`` and the blank line."""
    tail = b"}" if t_send is None else b',"t_send":%d}' % t_send
    return b"data: " + HEAD + choice_rest + b"]" + extra + tail + b"\n\n"


def make_turn(pieces: list[str], t_send: bool, rng: random.Random, session: int = 0) -> TurnRecorder:
    """One relayed turn: ``pieces`` streamed as content chunks, a chunked frame per read; its prompt is
    ``session``'s (the same system prompt, a user message per session, as bench_overhead's load sends)."""
    clock = [1_700_000_000_000_000_000]

    def stamp() -> int | None:
        clock[0] += rng.randrange(10**6, 10**8)  # ns between chunks
        return clock[0] if t_send else None

    events = [_event(b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}', stamp())]
    for piece in pieces:
        content = orjson.dumps(piece)  # as engines write it: raw UTF-8, escapes for quotes and controls
        events.append(_event(b'"delta":{"content":' + content + b'},"logprobs":null,"finish_reason":null}', stamp()))
    n = len(pieces)
    usage = b',"usage":{"prompt_tokens":1000,"completion_tokens":%d,"total_tokens":%d}' % (n, 1000 + n)
    events.append(_event(b'"delta":{},"logprobs":null,"finish_reason":"length"}', stamp(), usage))
    events.append(b"data: [DONE]\n\n")
    body = orjson.dumps({"model": "bench-model", "stream": True, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question {session}: explain speculative decoding."}]})
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=body, t_wall=time.time(), t_request=0.0)
    b.on_headers(0.01, 200, "text/event-stream", chunked=True)
    t = 0.05
    for ev in events:
        t += 0.02
        b.on_bytes(b"%x\r\n%b\r\n" % (len(ev), ev), t, t + 0.00002)
    b.on_bytes(b"0\r\n\r\n", t + 0.001, t + 0.00102)
    b.finish(t + 0.002)
    return b


def make_turns(tok, n: int, chunks: int, t_send: bool) -> list[TurnRecorder]:
    enc = tok._enc
    tokens = enc.encode(PROSE * 4)
    rng = random.Random(7 + t_send)
    turns = []
    for i in range(n):
        start = rng.randrange(0, len(tokens) - chunks)
        # a token a chunk, as an engine streams; bytes that end inside a character wait for the next
        pieces, pending = [], b""
        for tid in tokens[start : start + chunks]:
            pending += enc.decode_single_token_bytes(tid)
            try:
                pieces.append(pending.decode())
                pending = b""
            except UnicodeDecodeError:
                continue
        turns.append(make_turn(pieces, t_send, rng, i % SESSIONS))
        READS[id(turns[-1])] = list(turns[-1].reads)
    return turns


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


SESSIONS = 8  # the turns' conversations: each turn after a session's first is compared with its previous
READS: dict[int, list[bytes]] = {}  # each turn's reads as made (make_turns), for time_builds


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--chunks", type=int, default=100, help="content chunks per turn")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--phases", action="store_true", help="also time each phase of the build, in µs per turn")
    p.add_argument("--beside-relay", action="store_true",
                   help="also time the build sharing its CPU with a process relaying over loopback TCP")
    run(p.parse_args())


if __name__ == "__main__":
    main()
