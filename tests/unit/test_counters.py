"""Each count is defined once (``serve/counters.py`` ``COUNTS``): what ``Counters.read`` gives is exactly that
list, and /_specproxy/metrics shows each exported count with the value the state line reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from specproxy.serve.counters import COUNTS, SINK_COUNTS, Counters
from specproxy.serve.own_metrics import OwnMetrics
from specproxy.store.writer import Writer


def test_read_gives_every_count_of_the_list_and_nothing_else(tmp_path):
    writer = Writer(tmp_path / "t.db")
    try:
        counters = Counters(writer, lambda: 7)
        assert list(counters.read()) == [key for key, *_ in COUNTS]
    finally:
        writer.close()


def test_the_metrics_page_shows_what_the_counters_read(tmp_path):
    writer = Writer(tmp_path / "t.db")
    try:
        counters = Counters(writer, lambda: 7)
        counters.memory_budget = 1 << 30
        counters.in_flight, counters.measured_in_flight = 1, 1  # the proxy's own gauges
        for why in ("bad", "bad", "busy", "memory", "memory", "memory"):
            counters.rejected(why)
        counters.measure_failed()
        counters.measure_dropped_one()
        counters.measure_shed_one()
        counters.header_timed_out()
        read = counters.read()
        assert (read["in_flight"], read["measured_in_flight"], read["rejected_bad"], read["rejected_busy"],
                read["rejected_memory"], read["measure_errors"], read["measure_dropped"], read["measure_shed"],
                read["header_timeouts"], read["scrape_failures"]) == (1, 1, 2, 1, 3, 1, 1, 1, 1, 7)
        page = OwnMetrics(counters.read).exposition().decode()
        shown = {f.name: f.samples[0].value for f in text_string_to_metric_families(page) if f.samples}
        for key, name, _, kind in COUNTS:
            if name is None:
                continue
            family = name.removesuffix("_total") if kind == "counter" else name
            assert shown[family] == read[key], key
    finally:
        writer.close()


class _Shipper:
    def __init__(self, name: str, behind: int, seconds: float, shipped: int, failed: int, aside: int) -> None:
        self.name = name
        self.rows_behind, self.seconds_behind = behind, seconds
        self.rows_shipped, self.batches_failed, self.rows_set_aside = shipped, failed, aside


def test_the_sinks_figures_are_per_sink_on_the_page_summed_on_the_state_line_and_only_with_one(tmp_path):
    """With ``--sink`` the shippers' figures join the counts: summed on the state line (the oldest wait,
    the most), one series per sink on the metrics page (label ``sink``); without one they are absent, not
    zeros that would read as a sink keeping up."""
    writer = Writer(tmp_path / "t.db")
    try:
        counters = Counters(writer, lambda: 0, [_Shipper("pg-a", 3, 1.5, 10, 1, 0), _Shipper("pg-b", 4, 9.0, 5, 0, 2)])
        read = counters.read()
        assert [read[key] for key, *_ in SINK_COUNTS] == [7, 9.0, 15, 1, 2]
        page = OwnMetrics(counters.read, counters.read_sinks).exposition().decode()
        families = {f.name: f for f in text_string_to_metric_families(page)}
        for name, want in (("specproxy_sink_rows_behind", {"pg-a": 3, "pg-b": 4}),
                           ("specproxy_sink_seconds_behind", {"pg-a": 1.5, "pg-b": 9.0}),
                           ("specproxy_sink_rows_shipped", {"pg-a": 10, "pg-b": 5}),
                           ("specproxy_sink_batches_failed", {"pg-a": 1, "pg-b": 0}),
                           ("specproxy_sink_rows_set_aside", {"pg-a": 0, "pg-b": 2})):
            assert {s.labels["sink"]: s.value for s in families[name].samples
                    if not s.name.endswith("_created")} == want, name
        bare = Counters(writer, lambda: 0)
        assert not set(bare.read()) & {key for key, *_ in SINK_COUNTS}
        assert "specproxy_sink" not in OwnMetrics(bare.read, bare.read_sinks).exposition().decode()
    finally:
        writer.close()
