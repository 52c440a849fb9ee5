"""The concurrency chart's geometry: bars sit at their value on the axis, one value alone is one bar."""

from __future__ import annotations

import re

from specproxy.view import html

PLOT_W = html.W - html.ML - html.MR


def bars(values: list[int], counts: list[int]) -> list[tuple[float, float]]:
    svg = html._concurrency({"n": sum(counts), "values": values, "counts": counts}, {"median": values[0]})
    return [(float(x), float(w)) for x, w in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)]


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
