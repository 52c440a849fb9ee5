"""Every `compare` row held to its promise by simulation: in A/A pairs (both arms from one
process) a row says "faster" or "slower" 3-7% of the time, and its interval covers the true
ratio (1) 93-97% of the time, for every turn shape and arm size, over the pairs where it gives
an interval. A row may decline ("no interval (why)"): a cell where it declines nearly always is
declared (``ABSTAINS``) and asserted as declining; every other cell must give an interval in most
of its pairs, so no cell passes by declining.

The rows run the code compare runs: ``stats.ratio_batch`` is bootstrap_ratio's request-level
path (test_batch_is_the_single_comparison pins that), ``aggregate.aggregate_batch`` is
aggregate_ratio's turn-level path. Coverage of a true ratio other than 1 needs no second
simulation: every interval is scale-equivariant (B scaled by c gives the A/A interval times c,
pinned below), so coverage at a pure speed-up equals the A/A coverage.

Run with -s -n 0 to see the table (docs/statistics.md holds a copy). The table is kept in
``~/.cache/specproxy/aa-calibration/`` under a hash of the code that makes it (``_cache_path``): a
run that changed none of it reads the same seeded cells back instead of simulating them again. Cells a method cannot meet are
strict xfails with the measured reason: visible in every run, and a fix turns them into passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from specproxy.analyze import aggregate, stats
from specproxy.analyze.aggregate import aggregate_batch, aggregate_ratio
from specproxy.analyze.stats import ND, bootstrap_ratio, ratio_batch

PAIRS = 1000
SHAPES = ("lognormal", "fixed", "bimodal")
SIZES = (8, 15, 60)
ROWS = ("decode_tps", "ttft_s", "total_s", "aggregate c=1", "aggregate c=4")


def _ln(median: float, cv: float, size, rng) -> np.ndarray:
    return median * rng.lognormal(0.0, math.sqrt(math.log(1 + cv * cv)), size)


def turns(shape: str, size, rng) -> dict[str, np.ndarray]:
    """Turns of one arm: completion tokens, TTFT, decode speed and whole turn time.

    lognormal: outputs ~300 tokens (CV 40%), TTFT 0.5 s (30%), decode 50 tok/s (15%).
    fixed: every output 256 tokens (benchmarks), durations noisy as above.
    bimodal: 70% short turns (60 tokens, cached prompt: TTFT 0.2 s, 55 tok/s) and 30% long ones
    (900 tokens, TTFT 2.5 s, 40 tok/s): modes an order of magnitude apart.
    """
    if shape == "bimodal":
        long = rng.random(size) < 0.3
        tokens = np.where(long, np.round(_ln(900, 0.3, size, rng)), np.round(_ln(60, 0.3, size, rng)))
        ttft = np.where(long, _ln(2.5, 0.3, size, rng), _ln(0.2, 0.3, size, rng))
        tps = np.where(long, _ln(40, 0.15, size, rng), _ln(55, 0.15, size, rng))
    else:
        tokens = (np.maximum(1, np.round(_ln(300, 0.4, size, rng))) if shape == "lognormal"
                  else np.full(size, 256.0))
        ttft, tps = _ln(0.5, 0.3, size, rng), _ln(50, 0.15, size, rng)
    return {"completion_tokens": tokens, "ttft_s": ttft, "decode_tps": tps,
            "total_s": ttft + tokens / tps}


def timeline(total_s: np.ndarray, clients: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of each turn when ``clients`` closed-loop clients send turns back to back,
    with an exponential think time (mean 0.5 s) between a turn's end and that client's next."""
    m, n = total_s.shape
    per = -(-n // clients)
    busy = np.zeros((m, per * clients))
    busy[:, :n] = total_s + rng.exponential(0.5, (m, n))
    steps = busy.reshape(m, per, clients)
    start = np.cumsum(steps, axis=1) - steps + rng.uniform(0.0, 0.2, (m, 1, clients))
    start = start.reshape(m, per * clients)[:, :n]
    return start, start + total_s


def simulate(shape: str, n: int, seed: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    a, b = turns(shape, (PAIRS, n), rng), turns(shape, (PAIRS, n), rng)
    out = {}
    for row, higher in (("decode_tps", True), ("ttft_s", False), ("total_s", False)):
        r = ratio_batch(a[row], b[row], higher_is_better=higher, seed=seed)
        out[row] = _rates(r)
    for clients in (1, 4):
        sa, ea = timeline(a["total_s"], clients, rng)
        sb, eb = timeline(b["total_s"], clients, rng)
        lanes = np.arange(n) % clients  # the client (connection) each turn came on, as timeline deals them
        r = aggregate_batch(a["completion_tokens"], sa, ea, b["completion_tokens"], sb, eb,
                            lanes_a=lanes, lanes_b=lanes, seed=seed)
        out[f"aggregate c={clients}"] = _rates(r)
    return out


def _rates(r: dict[str, np.ndarray]) -> dict[str, float]:
    """Share of pairs with no interval, and the false verdict rate and coverage over the pairs
    that have one (NaN when none has): a row that declines a comparison makes no claim there."""
    shown = np.array([v is not None for v in r["verdict"]])
    called = np.isin(r["verdict"], ["faster", "slower"])
    covered = (r["ci_low"] <= 1.0) & (1.0 <= r["ci_high"])
    some = shown.any()
    return {"none": float(1.0 - shown.mean()), "false": float(called[shown].mean()) if some else math.nan,
            "coverage": float(covered[shown].mean()) if some else math.nan}


def _cache_path() -> Path:
    """Where this machine keeps the table for this code. The simulation is seeded, so its cells depend
    only on this file, the analysis modules it runs and numpy: the key hashes all of them, and any change
    to one computes the table afresh (about 25 s of CPU: a thousand bootstraps per cell)."""
    h = hashlib.sha256(np.__version__.encode())
    for path in sorted([Path(__file__), *Path(stats.__file__).parent.glob("*.py")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return Path.home() / ".cache" / "specproxy" / "aa-calibration" / f"{h.hexdigest()[:24]}.json"


def _computed() -> dict[tuple[str, str, int], dict[str, float]]:
    cells = {}
    for i, shape in enumerate(SHAPES):
        for j, n in enumerate(SIZES):
            for row, rates in simulate(shape, n, seed=100 + 10 * i + j).items():
                cells[(row, shape, n)] = rates
    return cells


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, str, int], dict[str, float]]:
    path = _cache_path()
    try:
        cells = {(row, shape, int(n)): rates for row, shape, n, rates in json.loads(path.read_text())}
    except (OSError, ValueError):
        cells = _computed()
        with contextlib.suppress(OSError):  # a read-only home computes it every run, nothing worse
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps([[*key, rates] for key, rates in cells.items()]))
            tmp.replace(path)
    head = f"{'row':15}" + "".join(f"{f'{s} n={n}':>17}" for s in SHAPES for n in SIZES)
    lines = [f"A/A calibration, {PAIRS} pairs per cell: false verdict % / coverage of the true ratio %, "
             "over the pairs with an interval", head]
    def rates(c: dict[str, float]) -> str:  # a cell that declines nearly always has too few pairs to rate
        if c["none"] >= ABSTAIN_SHARE:
            return f"{'(no interval)':>17}"
        return f"{c['false'] * 100:>9.1f} /{c['coverage'] * 100:>5.1f}"
    for row in ROWS:
        lines.append(f"{row:15}" + "".join(rates(cells[(row, s, n)]) for s in SHAPES for n in SIZES))
    lines += ["pairs with no interval %", head]
    for row in ROWS:
        lines.append(f"{row:15}" + "".join(f"{cells[(row, s, n)]['none'] * 100:>17.1f}" for s in SHAPES for n in SIZES))
    print("\n" + "\n".join(lines))
    return cells


# Cells the current methods do NOT meet (measured with the seeds above; docs/statistics.md).
# Open work: each is a strict xfail, so it is reported on every run and a fix shows as XPASS.
KNOWN: dict[tuple[str, str, int], str] = {  # none today: every cell meets its promise or is in ABSTAINS
}

# Cells where the row declines to compare: it says "no interval (why)" in at least ABSTAIN_SHARE
# of the pairs, and that is what is asserted there, not calibration. Every other cell must give an
# interval in at least 1 - MOST_SHARE of its pairs, and the promise holds over those pairs, so no
# cell passes by abstaining.
ABSTAIN_SHARE, MOST_SHARE = 0.9, 0.5
_LUMPY = ("30% long turns carry ~90% of the tokens: 16 turns pooled weigh as ~6 (Kish), ~3 effective turns per "
          "arm, fewer than 5 (a sample of 8 misses the long mode with P = 0.06 per arm, and no per-arm "
          "interval sees a mode its sample lacks: 9-12% false verdicts over three seed sets without the gate)")
ABSTAINS = {("aggregate c=1", "bimodal", 8): _LUMPY, ("aggregate c=4", "bimodal", 8): _LUMPY}


@pytest.mark.parametrize("row, shape, n", [
    pytest.param(row, shape, n, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[(row, shape, n)])]
                 if (row, shape, n) in KNOWN else [])
    for row in ROWS for shape in SHAPES for n in SIZES])
def test_row_keeps_its_promise(table, row, shape, n):
    rates = table[(row, shape, n)]
    if (row, shape, n) in ABSTAINS:
        assert rates["none"] >= ABSTAIN_SHARE, f"an interval in {1 - rates['none']:.1%} of pairs"
        return
    assert rates["none"] <= MOST_SHARE, f"no interval in {rates['none']:.1%} of pairs"
    assert 0.03 <= rates["false"] <= 0.07, f"false verdict rate {rates['false']:.3f}"
    assert 0.93 <= rates["coverage"] <= 0.97, f"coverage {rates['coverage']:.3f}"


def test_smooth_shapes_always_get_an_interval(table):
    """The effective-turns gate is for lumpy mixes: on smooth shapes every row compares."""
    none = {(row, s, n): table[(row, s, n)]["none"] for row in ROWS for s in ("lognormal", "fixed") for n in SIZES}
    assert max(none.values()) <= 0.01, {k: v for k, v in none.items() if v > 0.01}


def test_batch_is_the_single_comparison():
    rng = np.random.default_rng(5)
    x, y = turns("lognormal", (2, 15), rng)["total_s"]
    one = bootstrap_ratio(x, y, higher_is_better=False, seed=9)
    batch = ratio_batch(x[None], y[None], higher_is_better=False, seed=9)
    assert (one.estimate, one.ci_low, one.ci_high, one.verdict) == (
        batch["estimate"][0], batch["ci_low"][0], batch["ci_high"][0], batch["verdict"][0])
    t = turns("fixed", (2, 15), rng)
    s, e = timeline(t["total_s"], 4, rng)
    lanes = np.arange(15) % 4
    for known in (None, lanes):  # the jackknife over turns, and the schedule replay over lanes
        agg = aggregate_ratio((t["completion_tokens"][0], s[0], e[0]), (t["completion_tokens"][1], s[1], e[1]),
                              lanes_a=known, lanes_b=None if known is None else [f"c{i}" for i in known], seed=3)
        batch = aggregate_batch(t["completion_tokens"][0], s[0], e[0], t["completion_tokens"][1], s[1], e[1],
                                lanes_a=known, lanes_b=known, seed=3)
        assert agg.verdict == batch["verdict"][0]
        assert (agg.estimate, agg.ci_low, agg.ci_high) == pytest.approx(
            (batch["estimate"][0], batch["ci_low"][0], batch["ci_high"][0]), rel=1e-12)
        assert ("lanes" in agg.method) == (known is not None)


def test_intervals_are_scale_equivariant():
    """B 20% faster (speeds x1.2, times /1.2): the interval is the A/A one moved by exactly that
    factor, so coverage of the true ratio equals the A/A coverage in the table."""
    rng = np.random.default_rng(6)
    a, b = turns("bimodal", (50, 15), rng), turns("bimodal", (50, 15), rng)
    for row, c in (("decode_tps", 1.2), ("total_s", 1 / 1.2)):
        r0 = ratio_batch(a[row], b[row], higher_is_better=True, seed=1)
        r1 = ratio_batch(a[row], c * b[row], higher_is_better=True, seed=1)
        np.testing.assert_allclose(r1["ci_low"], c * r0["ci_low"], rtol=1e-9)
        np.testing.assert_allclose(r1["ci_high"], c * r0["ci_high"], rtol=1e-9)
    s, e = timeline(b["total_s"], 4, rng)
    s0, e0 = timeline(a["total_s"], 4, rng)
    for lanes in (None, np.arange(15) % 4):
        r0 = aggregate_batch(a["completion_tokens"], s0, e0, b["completion_tokens"], s, e, lanes_a=lanes, lanes_b=lanes)
        r1 = aggregate_batch(a["completion_tokens"], s0, e0, b["completion_tokens"], s / 1.2, e / 1.2,
                             lanes_a=lanes, lanes_b=lanes)
        shown = np.array([v is not None for v in r0["verdict"]])  # the effective-turns gate reads tokens only
        assert 0 < shown.sum() < shown.size and (shown == np.array([v is not None for v in r1["verdict"]])).all()
        np.testing.assert_allclose(r1["ci_low"], 1.2 * r0["ci_low"], rtol=1e-9)


def test_fixed_length_outputs_get_a_width():
    """The A/A pair of issue #19: every turn 256 tokens. Over tokens alone the interval had no
    width and said "slower" at 0.983 [0.983, 0.983]; over whole turns it has a width."""
    rng = np.random.default_rng(7)
    t = turns("fixed", (2, 60), rng)
    s, e = timeline(t["total_s"], 1, rng)
    r = aggregate_ratio((t["completion_tokens"][0], s[0], e[0]), (t["completion_tokens"][1], s[1], e[1]))
    assert r.ci_high / r.ci_low > 1.05 and r.ci_low <= 1.0 <= r.ci_high and r.verdict == ND


def test_one_long_turn_does_not_make_a_difference():
    """Arm a: seven short turns (~46 tok/s) and one long one (30 tok/s); arm b: eight short ones
    (it missed the long mode). B/A is 1.34, but it rests on one turn: leaving it out moves a's
    aggregate by as much. The delta method's SE saw only that turn's throughput deviation and
    called "faster" (1.34 [1.05, 1.71]). The long turn carries half of the pooled tokens: 16 turns
    weigh as 3.75, 1.9 per arm, and the row says so instead of comparing. Without that gate the
    jackknife's interval contains 1."""
    rng = np.random.default_rng(8)
    short_s = 1.3 * rng.lognormal(0.0, 0.02, 15)
    tokens_a = np.r_[np.full(7, 60.0), 900.0]
    dur_a = np.r_[short_s[:7], 30.0]
    tokens_b, dur_b = np.full(8, 60.0), short_s[7:]
    arm = lambda tok, dur: (tok, np.cumsum(dur) - dur, np.cumsum(dur))  # noqa: E731  back to back
    r = aggregate_ratio(arm(tokens_a, dur_a), arm(tokens_b, dur_b))
    assert r.estimate == pytest.approx(1.34, abs=0.01) and r.ci_low is None
    assert r.verdict == "no interval (a few turns carry most of the tokens: 1.9 effective turns per arm, 5 needed)"
    # the jackknife behind the gate (back to back, a turn's share is its duration) would not call it either
    parts = [aggregate._share_component(np.atleast_2d(t), np.atleast_2d(d))
             for t, d in ((tokens_a, dur_a), (tokens_b, dur_b))]
    lo, hi, _, _ = stats.combine(np.array([r.estimate]), parts, 0.95, higher_is_better=True)
    assert lo[0] < 1.0 < hi[0]


def test_effective_turns_judge_each_arm_by_both_arms_tokens():
    """Alike turns count fully, whatever the arm sizes; an arm whose turns are alike among themselves
    but short next to the other arm's long ones is judged with the pooled mix (on its own it would
    count 8 of 8); with unequal arms the reason names the arm short of effective turns."""
    ea, eb = aggregate.effective_turns(np.full(8, 256.0), np.full(20, 256.0))
    assert (ea[0], eb[0]) == pytest.approx((8.0, 20.0))
    mix = np.r_[np.full(21, 60.0), np.full(9, 900.0)]  # 30% long turns
    ea, eb = aggregate.effective_turns(mix, np.full(8, 60.0))
    assert eb[0] < 5 <= ea[0] and eb[0] / ea[0] == pytest.approx(8 / 30)
    assert aggregate.lumpy_reason(ea[0], eb[0], 30, 8) == (
        f"a few turns carry most of the tokens: {eb[0]:.1f} effective turns in arm b, 5 needed")
    back_to_back = lambda tok: (tok, np.arange(tok.size) * 2.0, np.arange(tok.size) * 2.0 + 1.5)  # noqa: E731
    r = aggregate_ratio(back_to_back(mix), back_to_back(np.full(8, 60.0)))
    assert r.verdict.startswith("no interval (a few turns carry most of the tokens") and "in arm b" in r.verdict
    alike = aggregate_ratio(back_to_back(np.full(30, 300.0)), back_to_back(np.full(8, 300.0)))
    assert not alike.verdict.startswith("no interval")
