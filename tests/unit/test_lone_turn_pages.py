"""Which scrape a lone turn's counter deltas start from (``serve/watch.py``, ``page_between``).

A scrape's page is built between its request's sending and its headers' arrival (``t_mono``, which
``latency_s`` is measured back from). The start must count the previous turn and nothing of this one:
sent at or after the previous turn ended, back before this one began. Only the stamp was checked before,
so a slow scrape sent just before the previous turn ended, back just after, could start the window with
a page that did not yet count that turn, and the next turn's deltas took it in.
"""

from __future__ import annotations

from specproxy.observe.scrape import ScrapeSample
from specproxy.observe.server_metrics import Snapshot
from specproxy.serve.watch import page_between


def sample(t_mono: float, latency_s: float | None, tokens: float) -> ScrapeSample:
    return ScrapeSample(t_mono=t_mono, t_wall=1e9 + t_mono, snapshot=Snapshot(server_kind="llamacpp",
                        generation_tokens_total=tokens), instance_id="i", latency_s=latency_s)


def test_the_latest_page_built_between_the_previous_turns_end_and_this_ones_start():
    # the previous turn ended at 10.0, this one began at 12.0
    taken = [sample(9.0, 0.01, 100), sample(10.4, 0.01, 160), sample(11.5, 0.02, 160)]
    assert page_between(taken, 10.0, 12.0) is taken[2]
    assert page_between(taken, 10.0, 11.0) is taken[1]  # the one back after this turn began is not it


def test_a_slow_scrape_sent_before_the_previous_turn_ended_is_not_the_start():
    taken = [sample(10.4, 0.01, 160), sample(11.9, 2.5, 100)]  # sent at 9.4, back at 11.9: the page predates 10.0
    assert page_between(taken, 10.0, 12.0) is taken[0]
    assert page_between(taken[1:], 10.0, 12.0) is None  # no page surely built in between: no join


def test_a_sample_without_its_latency_is_taken_as_sent_when_it_came_back():
    taken = [sample(10.5, None, 160)]
    assert page_between(taken, 10.0, 12.0) is taken[0]
    assert page_between(taken, 10.6, 12.0) is None
