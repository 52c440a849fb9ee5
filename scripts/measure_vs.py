"""One side of ``bench_measure.py --baseline``: the bench's turns (``measure_turns.py``) built by the
specproxy this interpreter imports, each compared with its session's previous turn as the measuring
thread does; prints ``{shape: µs per chunk}`` as JSON (median over the repeats, the first a warm-up).

Run by ``bench_measure.py`` twice per pair, by this checkout's interpreter and by the baseline
checkout's (its ``.venv/bin/python``, whose editable install is that checkout's package); it is not
given this checkout's path, so each side times its own package. Every figure is the timing thread's CPU
time. Each build gets its turn's reads back first, untimed (a build consumes them); their bytes stay
held for the next repeat, so no side frees them inside the timing.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

from measure_turns import READS, make_turns  # scripts/ is sys.path[0]: this script's own directory

from specproxy.measure.prefix import PrefixTracker
from specproxy.measure.tokens import load_tokenizer


def builder():
    """``build(turn, tokenizer, prefixes)``: ``build_record``; before issue 33 the recorder built itself."""
    try:
        from specproxy.measure.build import build_record
    except ImportError:
        return lambda turn, tok, prefixes: turn.build(tok, prefixes)
    return lambda turn, tok, prefixes: build_record(turn, tok, prefixes)


def main() -> None:
    n_turns, chunks, repeats = (int(a) for a in sys.argv[1:4])
    tok = load_tokenizer("tiktoken:o200k_base")
    build = builder()
    out = {}
    for shape in ("plain", "t_send"):
        turns = make_turns(tok, n_turns, chunks, shape == "t_send")
        nchunks = sum(len(b.reads) - 1 for b in turns)  # every read but the last-chunk frame is an event
        samples = []
        for _ in range(repeats + 1):
            prefixes = PrefixTracker()
            gc.collect()
            gc.disable()
            took = 0.0
            try:
                for b in turns:
                    b.reads = list(READS[id(b)])
                    t0 = time.thread_time()
                    build(b, tok, prefixes)
                    took += time.thread_time() - t0
            finally:
                gc.enable()
            samples.append(took / nchunks * 1e6)
        out[shape] = statistics.median(samples[1:])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
