"""The command line: parse, call, print. Every user error is one line on stderr and exit status 2.

The commands that read a database are here; ``serve`` and its option table are ``app/serve_cli.py``'s,
``bench`` and ``roofline`` ``app/bench_cli.py``'s, added to the group ``main`` below."""

from __future__ import annotations

import contextlib
import csv
import logging
import signal
import sys
import tempfile
from pathlib import Path

import click
import orjson

from specproxy import __version__
from specproxy.app.bench_cli import register as register_bench
from specproxy.app.cli_common import (BY_CHOICES, db_path, echo, friendly, open_db, open_source, prices_of, prices_option,
                                      read_db_option, report_of, slo_option, sqlite_only)
from specproxy.app.serve_cli import serve
from specproxy.config import is_pg_url, parse_slo
from specproxy.errors import SpecproxyError

log = logging.getLogger("specproxy")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specproxy")
def main() -> None:
    """Measure what users of an LLM inference server actually get.

    Run `specproxy serve --upstream URL`, point a chat client's base URL at the proxy's /v1, chat,
    then `specproxy report`. `specproxy demo` does all of it against a built-in scripted server.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


window_options = [
    click.option("--label", default=None, help="Only turns with this label"),
    click.option("--since", default=None, help="Only turns at or after this time (ISO 8601 UTC or epoch s)"),
    click.option("--until", default=None, help="Only turns before this time (ISO 8601 UTC or epoch s)"),
]


cache_option = click.option(
    "--cache/--no-cache", default=True, show_default=True,
    help="Read the turns through the columnar cache (beside an SQLite file: DB.cache/; of a PostgreSQL "
         "database: ~/.cache/specproxy/pg-*/), checked against the database on every run, rebuilt where it "
         "does not match; --no-cache reads the database only")


def _window(fn):
    for opt in reversed(window_options):
        fn = opt(fn)
    return fn


@main.command()
@read_db_option
@_window
@click.option("--json", "as_json", is_flag=True, help="Print the audit as JSON")
@click.option("--session", "session", default=None, metavar="ID",
              help="One session turn by turn (its id, or a unique start of it, as the audit prints it): what "
                   "changed in tokens per part, tools added and removed, predicted against reused cache")
@click.option("--by", "by", type=click.Choice(BY_CHOICES), default="client", show_default=True,
              help="Group the audit by the client (User-Agent), session, label, tenant or model")
@prices_option
@cache_option
@friendly
def audit(db: str | None, label: str | None, since: str | None, until: str | None, as_json: bool,
          session: str | None, by: str, prices_file: str | None, cache: bool) -> None:
    """What each client costs: prompt make-up per turn, sessions, what changed turn to turn, prefill; with
    --prices, in dollars too."""
    from specproxy.analyze.audit import audit_columns, build_audit, find_session, render_audit, render_session
    from specproxy.store.dataset import parse_time
    from specproxy.store.source import Window

    prices = prices_of(prices_file)
    with open_source(db, cache=cache) as store:
        turns = store.turns(Window(label, parse_time(since), parse_time(until)), audit_columns(by))
    a = build_audit(turns, source=db_path(db), by=by, prices=prices)
    if session is None:
        echo(a, render_audit, as_json)
        return
    found = find_session(a, session)
    if found is None:
        raise SpecproxyError(f"no session {session!r} (or more than one starting so) among the completed "
                                   f"turns with prompt counts in {db_path(db)}: `specproxy audit` lists them")
    echo(found, render_session, as_json)


@main.command()
@read_db_option
@_window
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the report's pictures to this file: one self-contained HTML page (opens offline)")
@click.option("--by", "by", type=click.Choice(BY_CHOICES), default=None,
              help="Add a table per client (User-Agent), session, label, tenant or model (with its cost, given --prices)")
@prices_option
@cache_option
@slo_option
@friendly
def report(db: str | None, label: str | None, since: str | None, until: str | None, as_json: bool,
           html_file: str | None, by: str | None, prices_file: str | None, cache: bool, slo: str | None) -> None:
    """What users actually got: TTFT, decode speed, tokens, prompt make-up, operating point; with --prices,
    what it cost; with --slo, the share of turns that met it and goodput."""
    from specproxy.analyze.report import render_text

    prices = prices_of(prices_file)
    objective = parse_slo(slo)
    if html_file is None:
        echo(report_of(db, label, since, until, cache=cache, prices=prices, by=by, slo=objective), render_text, as_json)
        return
    from specproxy.store.dataset import parse_time
    from specproxy.view.html import document
    from specproxy.view.snapshot import snapshot

    with open_source(db, cache=cache) as store:
        snap = snapshot(store, source=db_path(db), label=label, since=parse_time(since), until=parse_time(until),
                        prices=prices, by=by, slo=objective)
    try:
        Path(html_file).write_text(document(snap, live=False, title=f"specproxy report: {db_path(db)}"),
                                   encoding="utf-8")
    except OSError as exc:
        raise SpecproxyError(f"cannot write {html_file}: {exc.strerror or exc}") from None
    echo(snap["report"], render_text, as_json)
    if not as_json:
        click.echo(f"pictures written to {html_file}", err=True)


@main.command()
@read_db_option
@_window
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv", "replay", "mooncake"]), default="jsonl",
              show_default=True, help="replay: the request bodies `serve --capture` stored, for `specproxy bench "
                                      "--from FILE`; mooncake: a Mooncake trace (lengths, timing, block hash ids; no text)")
@click.option("--block-size", type=int, default=512, show_default=True,
              help="Prompt tokens per hash id of --format mooncake (a multiple of 64)")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default="-",
              help="File to write [default: stdout]")
@friendly
def export(db: str | None, label: str | None, since: str | None, until: str | None, fmt: str, block_size: int,
           output: str) -> None:
    """Every turn, one JSON object (or CSV row) each, with docs/metrics.md's field names; or with
    --format replay, every captured request body; with --format mooncake, a trace (docs/bench.md)."""
    from specproxy.record import FIELD_NAMES
    from specproxy.store.dataset import parse_time, where_clause
    from specproxy.store.queries import turn_rows
    from specproxy.store.source import Window

    if fmt == "replay":
        from specproxy.app.bench_cli import export_replay

        sqlite_only(db_path(db), "request bodies are captured in the proxy's own file and not shipped")
        with open_db(db) as conn:
            export_replay(conn, db_path(db), output, label=label, since=parse_time(since), until=parse_time(until))
        return
    if fmt == "mooncake":
        from specproxy.app.bench_cli import export_mooncake
        from specproxy.app.mooncake import check_block_size

        check_block_size(block_size)  # before the database: the option is wrong whatever it holds
        sqlite_only(db_path(db), "export --format mooncake reads the prompt block digests of a proxy's own file")
        with open_db(db) as conn:
            n, skipped = export_mooncake(conn, db_path(db), output, block_size=block_size, label=label,
                                         since=parse_time(since), until=parse_time(until))
        if skipped:
            click.echo(f"specproxy export: {n} turns written; {skipped} left out (no prompt block digests or no "
                       "output count: measured without a tokenizer, or before digests were recorded)", err=True)
        return
    window = Window(label, parse_time(since), parse_time(until))
    try:
        if is_pg_url(db_path(db)):
            from specproxy.store.pg_source import PgSource

            with PgSource(db_path(db)) as store:
                _write_rows(FIELD_NAMES, store.rows(FIELD_NAMES, window), fmt, output)
            return
        where, params = where_clause(**window.as_dict(), measured_only=False)
        with open_db(db) as conn:
            _write_rows(FIELD_NAMES, turn_rows(conn, FIELD_NAMES, where, params), fmt, output)
    except OSError as exc:  # no such directory, a read-only file system, a full disk: one line
        raise SpecproxyError(f"cannot write {output}: {exc.strerror or exc}") from None


def _write_rows(names, rows, fmt: str, output: str) -> None:
    """The selected rows as JSON lines or CSV, to ``output`` ("-": stdout)."""
    out = sys.stdout if output == "-" else open(output, "w", newline="")
    try:
        if fmt == "csv":
            writer = csv.writer(out)
            writer.writerow(names)
            writer.writerows(rows)
        else:
            for row in rows:
                out.write(orjson.dumps(dict(zip(names, row))).decode() + "\n")
    finally:
        if out is not sys.stdout:
            out.close()


@main.command("compare")
@click.argument("arm_a")
@click.argument("arm_b", required=False)
@read_db_option
@click.option("--negative-control", is_flag=True,
              help="Compare A against itself (random halves, by instance when it has several)")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap")
@click.option("--level", type=float, default=0.95, show_default=True,
              help="Confidence level of every interval (e.g. 0.99: a verdict on an A/A is then wrong 1% of the time)")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON")
@cache_option
@slo_option
@friendly
def compare_cmd(arm_a: str, arm_b: str | None, db: str | None, negative_control: bool, seed: int, level: float,
                as_json: bool, cache: bool, slo: str | None) -> None:
    """Ratio B/A with 95% intervals (--level) and a verdict: faster, slower or not distinguishable.

    An arm is a label (X-Specproxy-Label, or serve --label) or a time window @START..END
    (ISO 8601, UTC unless a zone is given), e.g. @2026-11-29T08:00..2026-11-29T09:00.
    """
    from specproxy.analyze.compare import (COMPARE_COLUMNS, check_level, compare, negative_control_report, parse_arm,
                                           render_compare)

    check_level(level)
    objective = parse_slo(slo)
    if not negative_control and arm_b is None:
        raise SpecproxyError("compare needs two arms (A B), or one arm with --negative-control")
    a = parse_arm(arm_a)
    b = None if negative_control else parse_arm(arm_b)
    with open_source(db, cache=cache) as store:
        data = [store.load(arm.window, COMPARE_COLUMNS) for arm in (a, b) if arm is not None]
    r = negative_control_report(a, *data, seed=seed, level=level, slo=objective) if b is None else \
        compare(a, b, *data, seed=seed, level=level, slo=objective)
    echo(r, render_compare, as_json)


@main.command()
@read_db_option
@click.option("--before", required=True, help="Delete rows from before this time (ISO 8601 UTC or epoch s)")
@click.option("--turns", "with_turns", is_flag=True,
              help="Also delete the turns from before it (the measurements themselves: they are gone for good)")
@click.option("--vacuum", is_flag=True,
              help="Then rewrite the file to give the freed space back to the disk (needs that much free space "
                   "again, and blocks a running serve's writes meanwhile); without it the space is reused by new rows")
@friendly
def prune(db: str | None, before: str, with_turns: bool, vacuum: bool) -> None:
    """Delete the server scrapes (and with --turns, the turns) stored before a time; print how many.

    serve deletes scrapes older than scrape_retention_days on its own; this is for doing it by hand,
    or for turns, which nothing deletes otherwise. Safe beside a running serve: it deletes in short
    transactions.
    """
    import time

    from specproxy.store import queries
    from specproxy.store.dataset import parse_time
    from specproxy.store.db import open_existing
    from specproxy.store.retention import delete_scrapes, delete_turns

    cutoff = parse_time(before)
    assert cutoff is not None  # --before is required
    if cutoff > time.time():
        raise SpecproxyError(f"--before {before} is in the future: that would delete rows being written now")
    path = db_path(db)
    if path.startswith(("postgresql://", "postgres://")):  # a fleet's database (serve --sink)
        _prune_postgres(path, cutoff, with_turns, vacuum)
        return
    size = Path(path).stat().st_size if Path(path).is_file() else 0
    scrapes = turns = counters = 0
    with open_existing(path, readonly=False) as conn:
        while n := delete_scrapes(conn, cutoff):  # chunk by chunk: each a short transaction
            scrapes += n
        while with_turns:
            n, joins = delete_turns(conn, cutoff)
            if not n:
                break
            turns, counters = turns + n, counters + joins
        if vacuum:
            queries.vacuum(conn)
    deleted = f"{scrapes} scrapes" + (f", {turns} turns and their {counters} counter joins" if with_turns else "")
    click.echo(f"deleted {deleted} from before {_iso(cutoff)} in {path}")
    if vacuum:
        click.echo(f"vacuumed: {size / 1e6:.1f} MB -> {Path(path).stat().st_size / 1e6:.1f} MB")


def _prune_postgres(url: str, cutoff: float, with_turns: bool, vacuum: bool) -> None:
    from specproxy.config import check_sink_url
    from specproxy.store.sinks.pg_retention import prune_postgres

    if vacuum:
        raise SpecproxyError("--vacuum is for an SQLite file: PostgreSQL's autovacuum reclaims the space, and "
                             "turns go by whole day partitions")
    check_sink_url(url)
    n = prune_postgres(url, cutoff, turns=with_turns)
    deleted = f"{n['scrapes']} scrapes" + (f", {n['turns']} turns ({n['partitions']} whole day partitions dropped) "
                                           f"and their {n['turn_counters']} counter joins" if with_turns else "")
    click.echo(f"deleted {deleted} from before {_iso(cutoff)} in {url}")


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@main.command()
@click.option("--db", default=None, help="Database for the demo's turns [default: a new temporary file]")
@click.option("--turns", type=int, default=8, show_default=True, help="Turns per client at each concurrency")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON")
@click.option("--stay", is_flag=True,
              help="After the traffic, keep the proxy and its live page up until Ctrl-C, then print the report")
@friendly
def demo(db: str | None, turns: int, as_json: bool, stay: bool) -> None:
    """Run a scripted inference server, the proxy and a chat-like client, then print the report."""
    from specproxy.app.demo import run_demo
    from specproxy.analyze.report import render_text
    import asyncio

    from specproxy.serve.service import install_uvloop

    if turns < 1:
        raise SpecproxyError("--turns must be at least 1")
    path = Path(db) if db else Path(tempfile.mkdtemp(prefix="specproxy-demo-")) / "demo.db"

    async def linger(url: str) -> None:
        """Until Ctrl-C or SIGTERM (a service manager's, or `kill`'s): either ends the demo with its report."""
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, done.set)
        click.echo(f"demo: the traffic is done; the live page stays at {url}/_specproxy/ until Ctrl-C, "
                   "then the report", err=True)
        await done.wait()

    install_uvloop()
    try:
        asyncio.run(run_demo(path, turns=turns, progress=lambda m: click.echo(m, err=True),
                             linger=linger if stay else None))
    except KeyboardInterrupt:
        if not stay:
            raise
        # --stay ends here: run_demo stopped the proxy and its writer, every turn is stored
    r = report_of(str(path))
    echo(r, render_text, as_json)
    if not as_json:
        click.echo(f"\nThe turns are in {path}: try `specproxy report --db {path} --json` or `specproxy export --db {path}`")


main.add_command(serve)
register_bench(main)

if __name__ == "__main__":
    main()
