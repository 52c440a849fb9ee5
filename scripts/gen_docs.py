"""Generate the docs that come from code: config.example.toml and docs/schema.md.

    python scripts/gen_docs.py          # rewrite them
    python scripts/gen_docs.py --check  # exit 1 when they are stale (the test suite runs this)
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

from specproxy.config import Config
from specproxy.fielddocs import field_docs
from specproxy.record import FIELD_DOCS, Record

ROOT = Path(__file__).resolve().parent.parent


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def config_example() -> str:
    docs = field_docs(Config)
    out = ["# specproxy configuration. Precedence: this file < SPECPROXY_* environment < command-line flags.",
           "# Generated from specproxy/config/settings.py by scripts/gen_docs.py; every key is shown with its default.", ""]
    for f in fields(Config):
        for line in textwrap.wrap(docs.get(f.name, ""), 98):
            out.append(f"# {line}")
        default = f.default if f.default is not MISSING else None
        env = f"SPECPROXY_{f.name.upper()}"
        out.append(f"# environment: {env}")
        if f.name == "prices":  # a table: an inline one, with made-up numbers said to be made up
            out.append("# (example numbers, not any provider's; or one [prices.\"MODEL\"] table per model at the "
                       "end of the file)")
            out.append('# prices = { "my-model" = { input = 0.5, cached_input = 0.05, cache_write = 0.625, '
                       'output = 2.0, reasoning = 2.0 } }')
        elif default is None:
            example = {"upstream": "http://127.0.0.1:8000", "label": "config-a", "tokenizer": "hf:/path/to/tokenizer-dir",
                       "admin_token": "a-long-random-secret", "proxy_name": "gpu-node-3",
                       "sink": "postgresql://specproxy@db.internal/fleet",
                       "otlp_endpoint": "http://collector:4318/v1/metrics",
                       "tenant_header": "x-team",
                       "tenant_secret_file": "/etc/specproxy/tenant-secret",
                       "tenant_secret": "a-long-random-secret-shared-by-the-fleet", "slo": "ttft=2s,tpot=50ms; batch: e2e=60s"}[f.name]  # every optional setting has one
            out.append(f"# {f.name} = {_toml_value(example)}")
        else:
            out.append(f"{f.name} = {_toml_value(default)}")
        out.append("")
    return "\n".join(out)


def schema_md() -> str:
    out = ["# The `turns` table and `specproxy export` fields", "",
           "Generated from `specproxy/record.py` by `scripts/gen_docs.py`. Names and meanings follow [metrics.md](metrics.md).",
           "", "| field | type | meaning |", "| --- | --- | --- |"]
    for f in fields(Record):
        doc = FIELD_DOCS.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{f.name}` | `{f.type}` | {doc} |")
    out += ["", "## The `captures` table", "",
            "Only with `serve --capture` (opt-in): each measured request's body as the client sent it, for "
            "`specproxy export --format replay` and `specproxy bench --from captured` ([bench.md](bench.md)). "
            "Headers are never stored, so neither are API keys. `specproxy prune --turns` deletes a turn's "
            "capture with it.", "",
            "| field | type | meaning |", "| --- | --- | --- |",
            "| `turn_id` | `str` | the turn's `id` |",
            "| `t_wall` | `float` | the turn's `t_wall` |",
            "| `method`, `path` | `str` | as the client sent them |",
            "| `content_encoding` | `str` | the request's Content-Encoding (empty when none); `body` is in it |",
            "| `body` | `bytes` | the request body, byte for byte |",
            "", "## The server's tables", "",
            "Written by `serve`, which polls the upstream's Prometheus page (Config `metrics_path`, every "
            "`scrape_interval_s`; [operations.md](operations.md), \"The server's counters\"). Counters are the "
            "server's own totals since it started; a report reads their differences between two scrapes of "
            "one instance.", "",
            "| table | field | meaning |", "| --- | --- | --- |",
            "| `scrapes` | `t_wall`, `t_mono` | when the scrape's response headers arrived: UTC epoch seconds, and "
            "the proxy's monotonic clock (for order and durations within one process). The server built the "
            "page before then |",
            "| `scrapes` | `latency_s` | seconds from sending the scrape's request to its headers' arrival: "
            "the page was built after `t_wall - latency_s`. A report's span ends at a scrape sent after the last "
            "turn ended, so that its page counts that turn ([report.md](report.md), \"The span\"); null for "
            "a failed scrape and on rows recorded before it (read as 0) |",
            "| `scrapes` | `instance_id` | the server process that built the page (a new start time, build or "
            "model list is a new instance: a restart); null when none was known yet |",
            "| `scrapes` | `server_kind` | `vllm`, `sglang` or `llamacpp`, read from the page's metric names; "
            "null for a failed scrape |",
            "| `scrapes` | `requests_running`, `requests_waiting` | the server's gauges of requests decoding "
            "and queued |",
            "| `scrapes` | `generation_tokens_total`, `prompt_tokens_total` | the server's counters of tokens "
            "generated (accepted draft tokens included) and of prompt tokens processed |",
            "| `scrapes` | `spec_drafts_total`, `spec_draft_tokens_total`, `spec_accepted_tokens_total` | "
            "speculative decoding's counters: verification passes that checked a draft, draft tokens proposed, "
            "draft tokens accepted (MAL is `1 + accepted / drafts` over a difference) |",
            "| `scrapes` | `spec_accept_length`, `spec_accept_rate` | SGLang's gauges of tokens per verification "
            "pass and of accepted over drafted tokens, over its last log interval (not counters) |",
            "| `scrapes` | `prefix_cache_queries_total`, `prefix_cache_hits_total` | prompt tokens looked up in "
            "the server's prefix cache, and those found there |",
            "| `scrapes` | `raw` | the page's samples as JSON `[name, labels, value]`, for what the columns do "
            "not hold |",
            "| `scrapes` | `error` | why a scrape failed (no figures then), null when it succeeded |",
            "| `instances` | `instance_id`, `first_seen`, `last_seen`, `detail` | each server instance, when "
            "the scrapes first and last saw it (UTC epoch seconds), and what identifies it (JSON) |",
            "| `turn_counters` | `turn_id`, `instance_id`, `seconds`, `generated_tokens`, `drafts`, "
            "`draft_tokens`, `accepted_tokens`, `mal`, `acceptance_rate` | a turn that ran alone joined with "
            "the server's counter differences over its own lifetime: from the latest scrape sent after the "
            "previous turn ended and back before this one began, to one sent after it ended |",
            "", "## The fleet's tables", "",
            "In the local SQLite file (its outbox for the sinks, `serve --sink`; [operations.md](operations.md), \"Fleet\"):", "",
            "| table | field | meaning |", "| --- | --- | --- |",
            "| `store_meta` | `key`, `value` | `store_id`: the file's own random id (32 hex digits), made once by its migration: the sink tells proxies that share a `proxy_name` apart by it |",
            "| `sink_progress` | `sink`, `tbl`, `last_rowid`, `updated` | per sink (its URL, never a password) and shipped table (`turns`, `scrapes`, `turn_counters`): the last local rowid the sink took, and when (UTC epoch seconds) |",
            "| `sink_refused` | `sink`, `tbl`, `row_key`, `reason`, `t_set_aside` | a row the sink refused (a turn's `id`, a scrape's `id`, a counter join's `turn_id`), PostgreSQL's one-line reason (never the row's values), when |",
            "", "In the fleet's PostgreSQL database (`store/sinks/pg_migrations.py`):", "",
            "| table | holds |", "| --- | --- |",
            "| `turns` | every field above, of every proxy; partitioned by UTC day on `t_wall` (`turns_YYYYMMDD`), keyed by (`id`, `t_wall`); booleans as SMALLINT 0/1, as SQLite holds them |",
            "| `scrapes` | the local `scrapes` rows, with `store_id` and `proxy_name` in front; keyed by (`store_id`, `id`) |",
            "| `turn_counters` | the local `turn_counters` rows (a lone turn's counter deltas), keyed by `turn_id`; `seq` numbers "
            "them in the order the database took them (migration `002_counters_seq`) |",
            "| `proxies` | `proxy_name`, the `store_id` that ships under it, `first_seen`, `last_seen` |",
            "| `turn_days` | per UTC day (`day`: `t_wall` // 86400), `changes`: how many INSERT, DELETE or UPDATE statements "
            "on `turns` touched that day, counted by statement-level triggers in the statement's transaction (migration "
            "`006_turn_days`); what the read side's column cache checks a day's segment by (`store/pg_cache.py`, report.md "
            "\"Over a fleet's PostgreSQL\") |",
            "| `specproxy_migrations` | the PostgreSQL migrations applied (`name`, `applied_at`) |"]
    return "\n".join(out) + "\n"


TARGETS = {ROOT / "config.example.toml": config_example, ROOT / "docs" / "schema.md": schema_md}


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for path, make in TARGETS.items():
        text = make()
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale generated docs (run python scripts/gen_docs.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
