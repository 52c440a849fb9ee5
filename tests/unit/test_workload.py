"""How often compare's workload guard (analyze/workload.py) withholds a verdict when both arms are one
setting's turns sampled twice: the A/A shapes of test_aa_calibration, 1000 seeded pairs a cell, the
completion tokens per turn (the prompt and mix rules read the same way). Run with -s -n 0 for the table
(docs/statistics.md holds a copy): seeded, so the same code gives the same numbers."""

from __future__ import annotations

import numpy as np

from specproxy.analyze.workload import RATIO_LIMIT, differences
from specproxy.store.dataset import Turns
from test_aa_calibration import SHAPES, SIZES, turns

PAIRS = 1000


def arm(tokens: np.ndarray) -> Turns:
    n = tokens.size
    return Turns({"t_wall": np.arange(n, dtype=float), "completion_tokens": tokens, "prompt_tokens": np.full(n, 500.0),
                  "streamed": np.ones(n)}, {"api": np.array(["chat"] * n, dtype=object)})


def fired(shape: str, n: int) -> float:
    rng = np.random.default_rng([SHAPES.index(shape), n, 7])
    a = turns(shape, (PAIRS, n), rng)["completion_tokens"]
    b = turns(shape, (PAIRS, n), rng)["completion_tokens"]
    return float(np.mean([bool(differences(arm(x), arm(y), ("completion_tokens",))) for x, y in zip(a, b)]))


def test_the_guard_on_one_settings_turns_sampled_twice():
    rates = {(shape, n): fired(shape, n) for shape in SHAPES for n in SIZES}
    print(f"\nworkload guard (mean completion tokens {RATIO_LIMIT}x apart) in A/A pairs, % withheld")
    print(f"{'':12}" + "".join(f"{f'n={n}':>8}" for n in SIZES))
    for shape in SHAPES:
        print(f"{shape:12}" + "".join(f"{rates[shape, n] * 100:8.1f}" for n in SIZES))
    # smooth shapes keep their verdicts (a 40% CV of output length: 1.5x apart only by bad luck at 8 turns)
    assert all(rates["fixed", n] == 0 for n in SIZES)
    assert rates["lognormal", 8] < 0.06 and rates["lognormal", 15] < 0.01 and rates["lognormal", 60] == 0
    # few long turns carrying most tokens: the samples themselves differ, often, until many turns
    assert rates["bimodal", 8] > rates["bimodal", 15] > rates["bimodal", 60]


def test_a_smaller_difference_or_unknown_counts_are_said_beside_the_verdict():
    """Means 1.45x apart (the audit's 57 short answers and three of 300 tokens against 60 short ones) keep
    the verdict but say the difference; an arm without token counts says that nobody can tell."""
    from specproxy.analyze.workload import notes

    short = np.full(60, 30.0)
    mixed = np.concatenate([np.full(57, 30.0), np.full(3, 300.0)])
    assert differences(arm(short), arm(mixed), ("completion_tokens",)) == []
    (said,) = notes(arm(short), arm(mixed), ("completion_tokens",))
    assert "mean 30 in A, 44 in B (1.45x)" in said and "short of the 1.5x" in said
    assert notes(arm(short), arm(short * 1.1), ("completion_tokens",)) == []  # 1.1x: nothing to say
    (said,) = notes(arm(short), arm(np.full(60, np.nan)), ("completion_tokens",))
    assert "unknown in B" in said and "cannot be told" in said
