"""A varied window of turns for the audit's tests, the same on every run (a seeded generator): several
clients (one of them NULL, one named as the NULL group reads), sessions whose rowids run against the
load order (start time), turns that failed or have no prompt count, NULL cached / predicted / TTFT
counts, prompts that tie (the median turn is picked among equal prompts), empty prompts, recorded diffs
and tool names (some rows without them), and models with and without a price."""

from __future__ import annotations

import numpy as np
import orjson

from specproxy.analyze.audit import audit_columns
from specproxy.prices import Price
from specproxy.store.dataset import NUMERIC, Turns

PRICES = {"m1": Price(input=3.0, output=15.0, cached_input=0.3, cache_write=3.75, reasoning=15.0),
          "m2": Price(input=1.0, output=2.0, cached_input=1.0, cache_write=1.0, reasoning=2.0)}
CLIENTS = ["agent/1", "agent/2", "chat/3", None, "(no User-Agent)", "(none)"]
TOOLS = ["read", "write", "grep", "run"]


def varied_turns(n: int = 160, seed: int = 36) -> Turns:
    rng = np.random.default_rng(seed)

    def pick(values, p=None):
        return [values[i] for i in rng.choice(len(values), size=n, p=p)]

    def maybe(values: np.ndarray, share_null: float) -> np.ndarray:
        return np.where(rng.random(n) < share_null, np.nan, values)

    parts = {p: rng.integers(lo, hi, n).astype(float) for p, lo, hi in
             (("system", 0, 4), ("tools", 0, 3), ("history", 0, 5), ("new", 0, 3))}
    empty = rng.random(n) < 0.08  # a prompt of 0 tokens: no share of it is new input
    parts = {p: np.where(empty, 0.0, v * 100) for p, v in parts.items()}  # few distinct sums: prompts tie
    prompt = sum(parts.values())
    counted = rng.random(n) > 0.1
    num = {f"prompt_{p}_tokens": np.where(counted, v, np.nan) for p, v in parts.items()}
    num["prompt_tokens"] = np.where(counted, prompt, np.nan)
    rowid = rng.permutation(n).astype(np.int64) + 1  # measured in another order than they started
    num.update(rowid=rowid, t_wall=1e9 + np.arange(n, dtype=float),
               ttft_s=maybe(0.05 + prompt * 2e-4 + rng.random(n) * 0.05, 0.1),
               streamed=maybe(rng.integers(0, 2, n).astype(float), 0.05),
               usage_cached_tokens=maybe(np.floor(prompt * rng.random(n)), 0.3),
               prefix_reused_tokens=maybe(np.floor(prompt * rng.random(n)), 0.3),
               tools_defined=maybe(rng.integers(0, 5, n).astype(float), 0.3),
               tools_called=maybe(rng.integers(0, 3, n).astype(float), 0.4),
               usage_prompt_tokens=maybe(prompt + 7, 0.2),
               completion_tokens=maybe(rng.integers(1, 300, n).astype(float), 0.1),
               usage_completion_tokens=maybe(rng.integers(1, 300, n).astype(float), 0.2),
               reasoning_tokens=maybe(rng.integers(0, 50, n).astype(float), 0.5),
               usage_cache_write_tokens=maybe(rng.integers(0, 100, n).astype(float), 0.5))
    diffs = [None, "", *(orjson.dumps({"messages_added": int(a), "messages_removed": int(r), "system_changed": bool(s),
                                       "tools_changed": bool(t)}).decode()
                         for a, r, s, t in rng.integers(0, 2, (6, 4)) * [2, 1, 1, 1])]
    names = [None, *(orjson.dumps({"defined": TOOLS[:k], "called": TOOLS[j:j + 1]}).decode()
                     for k, j in ((4, 0), (3, 1), (2, 3), (4, 2)))]
    txt = {"outcome": pick(["ok", "ok", "ok", "ok", "error", "client_abort", None]),
           "client": pick(CLIENTS, [0.35, 0.25, 0.15, 0.1, 0.1, 0.05]),
           "session": pick([None, *(f"sess-{k:02d}" for k in range(12))]),
           "api": pick([None, "", "chat", "messages"]), "prefix_break_part": pick([None, "system", "tools", "history"]),
           "turn_diff": pick(diffs), "tool_names": pick(names), "model": pick(["m1", "m2", "m3", None]),
           "label": pick(["a", "b", None]), "tenant": pick(["t1", "t2", None])}
    cols = audit_columns("client")
    num = {k: v for k, v in num.items() if k in cols or k == "rowid"}
    assert set(cols) <= set(num) | set(txt) and all(k in NUMERIC for k in num if k != "rowid")
    return Turns(num, {k: np.array(v, dtype=object) for k, v in txt.items()})
