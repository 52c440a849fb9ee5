"""The charts' geometry: the concurrency bars sit at their value on the axis, one value alone is one bar;
the speedup curve's ceiling is drawn inside the chart whether the axis reaches it or not."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specproxy.analyze.pictures import pictures
from specproxy.store.dataset import NUMERIC, Turns
from specproxy.view import html

PLOT_W = html.W - html.ML - html.MR


def bars(values: list[int], counts: list[int]) -> list[tuple[float, float]]:
    svg = html._concurrency({"n": sum(counts), "values": values, "counts": counts}, {"median": values[0]})
    return [(float(x), float(w)) for x, w in re.findall(r'<rect class="level"[^>]* x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)]


def test_a_single_value_is_one_narrow_bar_not_the_whole_width():
    ((x, w),) = bars([1], [12])
    assert x == html.ML and w < PLOT_W / 4


def test_a_bar_stands_at_its_value_on_the_axis():
    (x1, w1), (x4, _) = bars([1, 4], [3, 9])
    assert x1 == html.ML and w1 < PLOT_W / 4
    assert abs((x4 - html.ML) - 3 * (w1 + 1)) < 0.2  # three slots to the right of 1


def test_many_values_share_the_width():
    drawn = bars(list(range(1, 33)), [1] * 32)
    assert len(drawn) == 32 and drawn[-1][0] + drawn[-1][1] <= html.ML + PLOT_W + 0.1


def _ceiling(svg: str) -> tuple[str, float, str]:
    """The drawn ceiling's on-scale flag, its line's y and its label."""
    m = re.search(r'<g class="ceiling" data-value="([^"]+)" data-on-scale="(\d)"><line [^>]*y1="([^"]+)"[^>]*/>'
                  r'<text[^>]*>([^<]+)</text>', svg)
    assert m, svg
    return m.group(2), float(m.group(3)), m.group(4)


@pytest.mark.parametrize("ttft, decode, on_scale", [(1.0, 1.0, "1"), (1.0, 25.0, "0")])
def test_the_speedup_curve_always_draws_its_ceiling_inside_the_chart(ttft, decode, on_scale):
    """A ceiling within reach of the axis is drawn at its height; one far above (26x over a curve that
    reaches ~6x) is marked at the chart's top and says so, never left off."""
    p = pictures(turns([{"ttft_s": ttft, "decode_s": decode}]))
    ceiling = (ttft + decode) / ttft
    w = {"speedups": {}, "max_speedup": ceiling, "ttft_share": ttft / (ttft + decode)}
    flag, y, text = _ceiling(html._speedup(p["speedup_curve"], w))
    assert flag == on_scale and f"ceiling {ceiling:.2f}x" in text
    assert html.MT <= y <= html.H - html.MB
    if on_scale == "0":
        assert y == html.MT and "above this scale" in text
    else:
        top = max(v for _, v in p["speedup_curve"]["points"] if v is not None) * 1.08
        assert y == pytest.approx(html.H - html.MB - ceiling / max(top, ceiling * 1.08) * (html.H - html.MT - html.MB),
                                  abs=0.06)


def turns(rows: list[dict]) -> Turns:
    """Completed streamed turns started at 0 with the given columns; the rest NaN."""
    default = {"streamed": 1.0, "t_wall": 0.0}
    num = {k: np.array([float(r.get(k, default.get(k, np.nan))) for r in rows]) for k in NUMERIC}
    return Turns(num, {"outcome": np.array(["ok"] * len(rows), dtype=object)})


def test_the_diagonal_stays_inside_the_speedup_chart():
    """Engine speedups on x reach 3x while what users feel stays near 1.5x: the y = x reference line
    ends where it leaves the chart instead of running through the title."""
    svg = html._speedup({"points": [(1.25, 1.1), (1.5, 1.2), (2.0, 1.35), (3.0, 1.55)], "max_speedup": 2.2},
                        {"speedups": {}, "max_speedup": 2.2, "ttft_share": 0.45})
    (pts,) = re.findall(r'<polyline class="diagonal" points="([^"]+)"', svg)
    ys = [float(p.split(",")[1]) for p in pts.split()]
    assert min(ys) >= html.MT - 0.01  # no higher than the plot's top


def test_the_throughput_line_breaks_where_no_turn_started():
    """Issue #31: the line was drawn straight across minutes with no turns. Slots 0-1 and 4 have turns,
    slot 3 has turns but no streamed one: aggregate is drawn as two lines (0-1, 3-4), per stream as two
    (0-1, 4), every point still marked."""
    rows = [{"slot": 0, "t_wall": 0.5, "per_stream_tps": 20.0, "aggregate_tps": 40.0, "n": 2},
            {"slot": 1, "t_wall": 1.5, "per_stream_tps": 22.0, "aggregate_tps": 44.0, "n": 2},
            {"slot": 3, "t_wall": 3.5, "per_stream_tps": None, "aggregate_tps": 30.0, "n": 1},
            {"slot": 4, "t_wall": 4.5, "per_stream_tps": 18.0, "aggregate_tps": 36.0, "n": 1}]
    svg = html._timeline(rows)
    lines = {cls: [len(pts.split()) for pts in re.findall(rf'<polyline class="{cls}" points="([^"]*)"', svg)]
             for cls in ("aggregate", "per-stream")}
    assert lines == {"aggregate": [2, 2], "per-stream": [2, 1]}
    assert svg.count('<circle class="aggregate"') == 4 and svg.count('<circle class="per-stream"') == 3


def test_the_live_page_says_its_update_time_in_utc():
    """Like every other time on the page (the script's own clock read as UTC, never the browser's zone)."""
    assert "toLocaleTimeString" not in html.LIVE_SCRIPT and "toISOString().slice(11, 19) + ' UTC'" in html.LIVE_SCRIPT
