"""Each count is defined once (``serve/counters.py`` ``COUNTS``): what ``Counters.read`` gives is exactly that
list, and /_specproxy/metrics shows each exported count with the value the state line reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from specproxy.serve.counters import COUNTS, Counters
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
        counters.request_began()
        counters.request_began()
        counters.request_ended()
        counters.turn_began()
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
