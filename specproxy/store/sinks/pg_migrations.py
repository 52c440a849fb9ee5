"""PostgreSQL's schema for a fleet's turns: literal migrations, numbered and frozen, as SQLite's are
(``store/db.py``).

Why literal and frozen: every proxy of a fleet, whatever its version, brings the one shared database
through exactly the same steps, so two proxies can never leave it in two shapes; a change is a new
migration appended here (tests/integration/test_fleet_postgres.py holds every released one to its hash,
and the table built to the Record's fields).

The design: ``turns`` is partitioned by day on ``t_wall`` (one partition per UTC day, made as turns of
that day come; retention drops whole partitions, ``store/sinks/pg_retention.py``), keyed by the turn's
fleet-wide ``id`` (with ``t_wall``, which a partition key must be part of) so that a turn sent twice is
held once. Indexes: what the report's windows need and nothing more (the day partitions prune a time
window, ``t_wall`` orders inside one, ``label`` picks an arm). ``scrapes`` are keyed by the local
database that took them (``store_id``) and their local id. ``proxies`` says which local database ships
under which ``proxy_name``. ``seq`` numbers the turns in the order this database took them (the
analysis's load path asks a store for such a key, as SQLite's rowid is: ``store/source.py``). Booleans are SMALLINT, as SQLite stores them, so both databases load the
same columns.
"""

from __future__ import annotations

__all__ = ["PG_MIGRATIONS"]

PG_MIGRATIONS: list[tuple[str, tuple[str, ...]]] = [
    ("001_fleet", (
        """CREATE TABLE turns (
    id TEXT NOT NULL, t_wall DOUBLE PRECISION NOT NULL, method TEXT, path TEXT, api TEXT, client TEXT,
    session TEXT, status INTEGER, outcome TEXT, error TEXT, streamed SMALLINT, model TEXT, label TEXT,
    instance_id TEXT, request_parsed SMALLINT, concurrency INTEGER, conn_id BIGINT,
    t_request DOUBLE PRECISION, t_upstream_headers DOUBLE PRECISION, t_first_token DOUBLE PRECISION,
    t_last_token DOUBLE PRECISION, t_done DOUBLE PRECISION, ttft_s DOUBLE PRECISION, decode_s DOUBLE PRECISION,
    total_s DOUBLE PRECISION, completion_tokens INTEGER, content_tokens INTEGER, reasoning_tokens INTEGER,
    tool_args_tokens INTEGER, content_class TEXT, first_chunk_tokens INTEGER, usage_completion_tokens INTEGER,
    usage_prompt_tokens INTEGER, usage_cached_tokens INTEGER, chunks INTEGER, tokens_per_chunk DOUBLE PRECISION,
    decode_tps DOUBLE PRECISION, prompt_tokens INTEGER, prompt_system_tokens INTEGER,
    prompt_tools_tokens INTEGER, prompt_history_tokens INTEGER, prompt_new_tokens INTEGER,
    proxy_delay_s DOUBLE PRECISION, request_bytes BIGINT, response_bytes BIGINT, saw_done SMALLINT,
    finish_reason TEXT, server_timings TEXT, tokenizer TEXT, prompt_text TEXT, response_text TEXT,
    measure_capped SMALLINT, measure_capped_reason TEXT, measured SMALLINT, prefix_reused_tokens INTEGER,
    prefix_break_part TEXT, turn_diff TEXT, tools_defined INTEGER, tools_called INTEGER, tool_names TEXT,
    proxy_name TEXT NOT NULL, seq BIGSERIAL NOT NULL,
    PRIMARY KEY (id, t_wall)
) PARTITION BY RANGE (t_wall)""",
        "CREATE INDEX turns_t_wall ON turns (t_wall)",
        "CREATE INDEX turns_label ON turns (label, t_wall)",
        """CREATE TABLE scrapes (
    store_id TEXT NOT NULL, id BIGINT NOT NULL, proxy_name TEXT NOT NULL, t_wall DOUBLE PRECISION,
    t_mono DOUBLE PRECISION, instance_id TEXT, server_kind TEXT, requests_running DOUBLE PRECISION,
    requests_waiting DOUBLE PRECISION, generation_tokens_total DOUBLE PRECISION,
    prompt_tokens_total DOUBLE PRECISION, spec_drafts_total DOUBLE PRECISION,
    spec_draft_tokens_total DOUBLE PRECISION, spec_accepted_tokens_total DOUBLE PRECISION,
    spec_accept_length DOUBLE PRECISION, spec_accept_rate DOUBLE PRECISION, raw TEXT, error TEXT,
    PRIMARY KEY (store_id, id)
)""",
        "CREATE INDEX scrapes_t_wall ON scrapes (t_wall)",
        """CREATE TABLE turn_counters (
    turn_id TEXT PRIMARY KEY, instance_id TEXT, seconds DOUBLE PRECISION, generated_tokens DOUBLE PRECISION,
    drafts DOUBLE PRECISION, draft_tokens DOUBLE PRECISION, accepted_tokens DOUBLE PRECISION,
    mal DOUBLE PRECISION, acceptance_rate DOUBLE PRECISION
)""",
        """CREATE TABLE proxies (
    proxy_name TEXT PRIMARY KEY, store_id TEXT NOT NULL, first_seen DOUBLE PRECISION, last_seen DOUBLE PRECISION
)""",
    )),
    # the order the database took the counter joins, as SQLite's rowid gives it (the read side, pg_source.py,
    # hands the lone-turn deltas to the analysis in that order, as sqlite_source.py does)
    ("002_counters_seq", (
        "ALTER TABLE turn_counters ADD COLUMN seq BIGSERIAL NOT NULL",
    )),
    ("003_tenant", (
        "ALTER TABLE turns ADD COLUMN tenant TEXT",
    )),
    ("004_prefix_cache", (
        "ALTER TABLE turns ADD COLUMN usage_cache_write_tokens INTEGER",
        "ALTER TABLE scrapes ADD COLUMN prefix_cache_queries_total DOUBLE PRECISION",
        "ALTER TABLE scrapes ADD COLUMN prefix_cache_hits_total DOUBLE PRECISION",
    )),
    ("005_prompt_block_digests", (
        "ALTER TABLE turns ADD COLUMN prompt_block_digests TEXT",
    )),
    # what the read side's column cache (store/pg_cache.py) is checked by: per UTC day (a partition), how
    # many statements have changed its turns, counted in the same transaction as the change, so a day
    # whose count is the cached one holds the cached rows (one statement-level trigger per batch shipped)
    ("006_turn_days", (
        "CREATE TABLE turn_days (day BIGINT PRIMARY KEY, changes BIGINT NOT NULL)",
        """CREATE FUNCTION specproxy_turn_days() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE days BIGINT[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        days := ARRAY(SELECT DISTINCT floor(t_wall / 86400)::BIGINT FROM new_rows);
    ELSIF TG_OP = 'DELETE' THEN
        days := ARRAY(SELECT DISTINCT floor(t_wall / 86400)::BIGINT FROM old_rows);
    ELSE
        days := ARRAY(SELECT DISTINCT floor(t_wall / 86400)::BIGINT FROM
                      (SELECT t_wall FROM old_rows UNION ALL SELECT t_wall FROM new_rows) x);
    END IF;
    INSERT INTO turn_days (day, changes) SELECT d, 1 FROM unnest(days) d ORDER BY d
        ON CONFLICT (day) DO UPDATE SET changes = turn_days.changes + 1;
    RETURN NULL;
END $$""",
        "CREATE TRIGGER turn_days_insert AFTER INSERT ON turns REFERENCING NEW TABLE AS new_rows "
        "FOR EACH STATEMENT EXECUTE FUNCTION specproxy_turn_days()",
        "CREATE TRIGGER turn_days_delete AFTER DELETE ON turns REFERENCING OLD TABLE AS old_rows "
        "FOR EACH STATEMENT EXECUTE FUNCTION specproxy_turn_days()",
        "CREATE TRIGGER turn_days_update AFTER UPDATE ON turns REFERENCING OLD TABLE AS old_rows NEW TABLE AS "
        "new_rows FOR EACH STATEMENT EXECUTE FUNCTION specproxy_turn_days()",
    )),
    ("007_scrape_latency", (
        "ALTER TABLE scrapes ADD COLUMN latency_s DOUBLE PRECISION",
    )),
]
