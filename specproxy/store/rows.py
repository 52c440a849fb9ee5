"""The writes that are not turns, as ``(sql, params)`` pairs for ``Writer.put``: a scrape, a server
instance, a lone turn's counter deltas.

Why here: the SQL lives in the store (one place to read it beside the schema); the observers above
only say what to write, and the writer thread runs it with the turns, in the same batches.
"""

from __future__ import annotations

__all__ = ["SCRAPE_COLUMNS", "TURN_COUNTER_COLUMNS", "failed_scrape", "instance_seen", "scrape", "turn_counters"]

SCRAPE_COLUMNS = (
    "t_wall", "t_mono", "instance_id", "server_kind", "requests_running", "requests_waiting",
    "generation_tokens_total", "prompt_tokens_total", "spec_drafts_total", "spec_draft_tokens_total",
    "spec_accepted_tokens_total", "spec_accept_length", "spec_accept_rate", "raw", "error",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "latency_s",
)
_INSERT_SCRAPE = f"INSERT INTO scrapes ({', '.join(SCRAPE_COLUMNS)}) VALUES ({', '.join('?' * len(SCRAPE_COLUMNS))})"
_UPSERT_INSTANCE = (
    "INSERT INTO instances (instance_id, first_seen, last_seen, detail) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(instance_id) DO UPDATE SET last_seen = excluded.last_seen"
)
TURN_COUNTER_COLUMNS = ("turn_id", "instance_id", "seconds", "generated_tokens", "drafts", "draft_tokens",
                         "accepted_tokens", "mal", "acceptance_rate")
_INSERT_TURN_COUNTERS = (f"INSERT OR REPLACE INTO turn_counters ({', '.join(TURN_COUNTER_COLUMNS)}) "
                         f"VALUES ({', '.join('?' * len(TURN_COUNTER_COLUMNS))})")


def scrape(values: tuple, *, prefix_cache_queries: float | None = None,
           prefix_cache_hits: float | None = None, latency_s: float | None = None) -> tuple[str, tuple]:
    """A scrape row: ``values`` in ``SCRAPE_COLUMNS`` order up to ``error``; the columns added later, at
    the end, by name (the prefix cache's counters; ``latency_s``, the request sent to the headers)."""
    assert len(values) == len(SCRAPE_COLUMNS) - 3
    return _INSERT_SCRAPE, (*values, prefix_cache_queries, prefix_cache_hits, latency_s)


def failed_scrape(t_wall: float, t_mono: float, instance_id: str | None, error: str | None) -> tuple[str, tuple]:
    """A scrape that failed: its time and error, no figures."""
    values = dict.fromkeys(SCRAPE_COLUMNS)
    values.update(t_wall=t_wall, t_mono=t_mono, instance_id=instance_id, error=error)
    return _INSERT_SCRAPE, tuple(values.values())


def instance_seen(instance_id: str, t_wall: float, detail: str) -> tuple[str, tuple]:
    """A server instance seen at ``t_wall``: added when new (``detail``: its identity as JSON), else its
    ``last_seen`` moved."""
    return _UPSERT_INSTANCE, (instance_id, t_wall, t_wall, detail)


def turn_counters(turn_id: str, instance_id: str, seconds: float, generated_tokens, drafts, draft_tokens,
                  accepted_tokens, mal, acceptance_rate) -> tuple[str, tuple]:
    """A lone turn joined with the server's counter deltas over its lifetime."""
    return _INSERT_TURN_COUNTERS, (turn_id, instance_id, seconds, generated_tokens, drafts, draft_tokens,
                                   accepted_tokens, mal, acceptance_rate)
