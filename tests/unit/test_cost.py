"""The cost rule (analyze/cost.py): cached tokens at the cached price, the rest at the input price, output
and reasoning apart; null, never 0, when a needed count or the model's price is missing; and what each
prompt part costs, the cache covering the prompt's start. Every expected figure is worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specproxy.analyze import cost
from specproxy.analyze.cost import COST_COLUMNS, cost_by, cost_summary, render_cost_lines, turn_costs
from specproxy.errors import ConfigError
from specproxy.prices import load_prices, parse_prices
from specproxy.store.dataset import TEXT, Turns

PRICES = parse_prices({"m": {"input": 2.0, "cached_input": 0.5, "output": 10.0, "reasoning": 20.0},
                       "flat": {"input": 1.0, "output": 4.0}}, "test")


def turns(rows: list[dict], extra: tuple[str, ...] = ()) -> Turns:
    num, txt = {}, {}
    for col in (*COST_COLUMNS, *extra):
        values = [r.get(col) for r in rows]
        if col in TEXT:
            txt[col] = np.array(values, dtype=object)
        else:
            num[col] = np.array([np.nan if v is None else float(v) for v in values])
    num["t_wall"] = np.arange(len(rows), dtype=float)
    return Turns(num, txt)


def row(**kw) -> dict:
    base = {"model": "m", "outcome": "ok", "prompt_tokens": 1000, "usage_prompt_tokens": 1000,
            "usage_cached_tokens": 600, "completion_tokens": 100, "usage_completion_tokens": 101,
            "reasoning_tokens": 40, "prompt_system_tokens": 200, "prompt_tools_tokens": 500,
            "prompt_history_tokens": 250, "prompt_new_tokens": 50}
    base.update(kw)
    return base


def test_cached_and_uncached_prompt_tokens_and_reasoning_are_priced_apart():
    c = turn_costs(turns([row()]), PRICES)
    # 400 uncached x $2 + 600 cached x $0.5 + 60 output x $10 + 40 reasoning x $20, per million
    assert c.kinds["input"][0] == pytest.approx(400 * 2.0e-6)
    assert c.kinds["cached_input"][0] == pytest.approx(600 * 0.5e-6)
    assert c.kinds["output"][0] == pytest.approx(60 * 10e-6)
    assert c.kinds["reasoning"][0] == pytest.approx(40 * 20e-6)
    assert c.kinds["cache_write"][0] == 0
    assert c.usd[0] == pytest.approx((800 + 300 + 600 + 800) * 1e-6)
    assert c.why[0] is None


def test_the_cached_tokens_are_the_prompts_first_so_the_injected_parts_are_the_cheap_ones():
    c = turn_costs(turns([row()]), PRICES)
    # cached 600 covers system (200) and the first 400 of the tools (500); the rest is uncached
    assert c.parts["system"][0] == pytest.approx(200 * 0.5e-6)
    assert c.parts["tools"][0] == pytest.approx((400 * 0.5 + 100 * 2.0) * 1e-6)
    assert c.parts["history"][0] == pytest.approx(250 * 2.0e-6)
    assert c.parts["new"][0] == pytest.approx(50 * 2.0e-6)
    prompt_usd = c.kinds["input"][0] + c.kinds["cached_input"][0]
    assert sum(c.parts[p][0] for p in cost.PARTS) == pytest.approx(prompt_usd)


def test_a_missing_count_that_is_priced_apart_nulls_the_cost_and_says_why():
    rows = [row(usage_cached_tokens=None), row(reasoning_tokens=None), row(model="other"), row(model=None),
            row(prompt_tokens=None, usage_prompt_tokens=None), row(completion_tokens=None, usage_completion_tokens=None),
            row(outcome="upstream_error")]
    c = turn_costs(turns(rows), PRICES)
    assert np.isnan(c.usd).all()
    assert all(np.isnan(c.parts[p]).all() for p in cost.PARTS)
    assert list(c.why) == ["no cached-token count from the server", "no reasoning-token count",
                           "no price for its model", "no price for its model", "no prompt count", "no output count",
                           "no answer (the upstream failed or was never reached)"]


def test_a_count_the_table_does_not_price_apart_is_not_needed():
    # "flat" has no cached or reasoning price: unknown cached and reasoning counts cost nothing extra
    c = turn_costs(turns([row(model="flat", usage_cached_tokens=None, reasoning_tokens=None)]), PRICES)
    assert c.usd[0] == pytest.approx((1000 * 1.0 + 100 * 4.0) * 1e-6)


def test_without_its_own_counts_the_servers_usage_is_priced():
    c = turn_costs(turns([row(model="flat", prompt_tokens=None, completion_tokens=None, usage_prompt_tokens=900,
                              usage_completion_tokens=80)]), PRICES)
    assert c.usd[0] == pytest.approx((900 * 1.0 + 80 * 4.0) * 1e-6)
    assert np.isnan(c.parts["tools"][0])  # the parts split specproxy's own count, not the server's
    # with a reasoning price, the server's output count has no reasoning split: null
    c = turn_costs(turns([row(completion_tokens=None)]), PRICES)
    assert c.why[0] == "no reasoning-token count"


def test_an_aborted_turn_is_priced_for_what_was_processed():
    c = turn_costs(turns([row(outcome="client_abort")]), PRICES)
    assert math.isfinite(c.usd[0])


def test_a_cached_count_above_the_prompt_is_clipped_to_it():
    c = turn_costs(turns([row(model="m", usage_cached_tokens=5000)]), PRICES)
    assert c.kinds["input"][0] == 0
    assert c.kinds["cached_input"][0] == pytest.approx(1000 * 0.5e-6)


def test_sums_per_group_and_of_every_dollar():
    rows = [row(client="a"), row(client="a"), row(client="b", model="nope"), row(client=None)]
    t = turns(rows, extra=("client",))
    c = turn_costs(t, PRICES)
    s = cost_summary(c)
    one = 2500e-6
    assert s["priced"] == 3 and s["usd"] == pytest.approx(3 * one) and s["usd_per_turn"] == pytest.approx(one)
    assert s["unpriced"] == {"no price for its model": 1}
    share = s["parts"]["of_every_dollar"]
    assert share["tools"] == pytest.approx(400e-6 / one)
    assert sum(share.values()) == pytest.approx(1.0)
    groups = {g["group"]: g for g in cost_by(t, c, "client")}
    assert groups["a"]["usd"] == pytest.approx(2 * one) and groups["(none)"]["priced"] == 1
    assert groups["b"]["usd"] is None and groups["b"]["priced"] == 0
    text = "\n".join(render_cost_lines(s))
    assert "3 of 4 turns priced (not priced: 1 no price for its model)" in text
    assert "tool definitions $0.16" in text


def test_cache_writes_are_priced_when_the_record_keeps_them(monkeypatch):
    # the field comes with the Messages API's cache_creation_input_tokens (another branch); until then none
    monkeypatch.setattr(cost, "CACHE_WRITE", (cost.CACHE_WRITE_COLUMN,))
    prices = parse_prices({"m": {"input": 2.0, "cached_input": 0.5, "cache_write": 3.0, "output": 10.0}}, "t")
    t = turns([row(reasoning_tokens=0)], extra=(cost.CACHE_WRITE_COLUMN,))
    t.num[cost.CACHE_WRITE_COLUMN] = np.array([300.0])
    c = turn_costs(t, prices)
    assert c.kinds["cache_write"][0] == pytest.approx(300 * 3.0e-6)
    assert c.kinds["input"][0] == pytest.approx(100 * 2.0e-6)
    # writes follow the cached 600: tools 600..700 is 100 of them; history 700..950 is 200 writes + 50 input
    assert c.parts["tools"][0] == pytest.approx((400 * 0.5 + 100 * 3.0) * 1e-6)
    assert c.parts["history"][0] == pytest.approx((200 * 3.0 + 50 * 2.0) * 1e-6)


@pytest.mark.parametrize("table, said", [
    ({"m": {"input": 1}}, "needs output"),
    ({"m": {"input": 1, "output": -2}}, "at least 0"),
    ({"m": {"input": 1, "output": "2"}}, "must be a number"),
    ({"m": {"input": 1, "output": 2, "cached": 1}}, "unknown price 'cached'"),
    ({"m": 3}, "must be a table of prices"),
])
def test_a_bad_price_table_is_one_line(table, said):
    with pytest.raises(ConfigError) as err:
        parse_prices(table, "f.toml")
    assert said in str(err.value) and "\n" not in str(err.value)


def test_prices_file_reads_the_prices_table_of_a_config_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('upstream = "http://127.0.0.1:8000"\n[prices."qwen"]\ninput = 0.5\noutput = 2.0\n')
    p = load_prices(f)["qwen"]
    assert (p.input, p.cached_input, p.cache_write, p.output, p.reasoning) == (0.5, 0.5, 0.5, 2.0, 2.0)
    (tmp_path / "none.toml").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="has no prices table"):
        load_prices(tmp_path / "none.toml")
    with pytest.raises(ConfigError, match="not found"):
        load_prices(tmp_path / "missing.toml")


def test_the_by_table_groups_the_reports_figures_and_cost():
    from specproxy.analyze.groups import GROUP_COLUMNS, by_group, render_by

    rows = [row(tenant="t1", streamed=1, ttft_s=0.2, decode_tps=50.0),
            row(tenant="t1", streamed=1, ttft_s=0.4, decode_tps=70.0),
            row(tenant="t1", streamed=0, ttft_s=9.0, decode_tps=None),  # not streamed: not in the medians
            row(tenant="t2", streamed=1, ttft_s=1.0, decode_tps=10.0, outcome="client_abort"),
            row(tenant=None, streamed=1, ttft_s=0.1, decode_tps=5.0, usage_cached_tokens=None)]
    t = turns(rows, extra=tuple(c for c in GROUP_COLUMNS if c not in COST_COLUMNS) + ("tenant",))
    section = by_group(t, "tenant", PRICES)
    g = {x["group"]: x for x in section["groups"]}
    assert [x["group"] for x in section["groups"]] == ["t1", "(none)", "t2"]  # most turns first, then by name
    assert (g["t1"]["turns"], g["t1"]["completed"]) == (3, 3)
    assert g["t1"]["ttft_p50_s"] == pytest.approx(0.3) and g["t1"]["decode_tps_p50"] == pytest.approx(60.0)
    assert g["t2"]["completed"] == 0 and g["t2"]["ttft_p50_s"] is None  # completed turns only
    assert g["t1"]["prompt_tokens"] == 3000 and g["t1"]["server_cached_share"] == pytest.approx(0.6)
    assert g["t1"]["cost"]["usd"] == pytest.approx(3 * 2500e-6) and g["t2"]["cost"]["priced"] == 1
    assert g["(none)"]["cost"]["unpriced"] == {"no cached-token count from the server": 1}
    assert by_group(t, "tenant", None)["groups"][0]["cost"] is None
    text = "\n".join(render_by(section))
    assert text.startswith("By tenant (3 groups;") and "$0.0075" in text
