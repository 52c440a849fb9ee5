"""What every command of the command line shares: one-line errors, the ``--db`` option, reading a database.

Why apart from ``cli.py``: ``bench_cli.py`` adds its commands to ``cli.py``'s group and uses these too;
here, both import them and neither imports the other back (``python -m specproxy.app.cli`` runs ``cli``
as ``__main__``, and a second copy of it, imported by ``bench_cli``, would get the commands).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import click
import orjson

from specproxy.config import Config, is_pg_url, load_config
from specproxy.errors import SpecproxyError

__all__ = ["BY_CHOICES", "DEFAULTS", "by_option", "db_option", "db_path", "echo", "friendly", "open_db", "open_source",
           "prices_of", "prices_option", "read_db_option", "report_of", "setting", "shown", "slo_option", "sqlite_only"]


def friendly(fn):
    """Turn SpecproxyError into one clear line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecproxyError as exc:
            click.echo(f"specproxy: error: {exc}", err=True)
            sys.exit(2)

    return wrapper


def shown(value: Any) -> str:
    """A default as a user would type it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


DEFAULTS = Config()


def setting(flag: str, key: str, help: str, **kwargs: Any):
    """The option that sets Config ``key``; not given, the config file's, SPECPROXY_<KEY>'s or the default
    value holds. The default in the help is read from Config, so help and code cannot differ."""
    return click.option(flag, key, default=None, help=f"{help} [default: {shown(getattr(DEFAULTS, key))}]",
                        **kwargs)


db_option = setting("--db", "db", "SQLite database file")
# the commands that read only: a fleet's PostgreSQL database (serve --sink) as well (store/pg_source.py)
read_db_option = setting("--db", "db", "SQLite database file, or a fleet's postgresql://USER@HOST[:PORT]/DB "
                                       "(the password from PGPASSWORD or ~/.pgpass)")


# what --by groups by (analyze/cost.py's BY_KEYS; here too so that --help needs no analysis imported)
BY_CHOICES = ("client", "session", "label", "tenant", "model")
prices_option = click.option(
    "--prices", "prices_file", type=click.Path(dir_okay=False), default=None,
    help="TOML file with the price table ([prices.\"MODEL\"]: input, cached_input, cache_write, output, reasoning "
         "in USD per million tokens; a serve config file will do): adds what the turns cost [default: no prices, "
         "no cost]")


def prices_of(prices_file: str | None) -> dict | None:
    """The price table of ``--prices FILE``, or None."""
    if prices_file is None:
        return None
    from specproxy.prices import load_prices

    return load_prices(prices_file)

slo_option = click.option(
    "--slo", "slo", default=None,
    help="Judge every turn by a service-level objective, e.g. ttft=2s,tpot=50ms,e2e=30s (any of them; ms or s): "
         "the share of turns that met it, with its interval, and goodput (docs/metrics.md, Goodput under an SLO)")


def db_path(db: str | None) -> str:
    return db or load_config(overrides={}).db


def open_db(db: str | None):
    """The SQLite file for reading: every way it can be the wrong file is one line (store.open_existing)."""
    from specproxy.store.db import open_existing

    path = sqlite_only(db_path(db), "this reads the SQLite file's own tables")
    return open_existing(path)


def sqlite_only(db: str, why: str) -> str:
    """``db`` unless it is a PostgreSQL URL, which only the read commands take (report, compare, audit,
    export, roofline): a command that writes, or reads what is not shipped, says so in one line."""
    if is_pg_url(db):
        raise SpecproxyError(f"--db is a PostgreSQL URL, which report, compare, audit, export and roofline read; "
                             f"{why}: give an SQLite file")
    return db


@contextlib.contextmanager
def open_source(db: str | None, *, cache: bool = False):
    """The store the analysis reads (``store.source.Source``): an SQLite file, or a fleet's PostgreSQL
    database when ``db`` is a ``postgresql://`` URL (``store/pg_source.py``); closed on leaving."""
    from specproxy.store.sqlite_source import SQLiteSource

    path = db_path(db)
    if is_pg_url(path):
        from specproxy.store.pg_source import PgSource

        with PgSource(path, cache=cache) as store:
            yield store
        return
    with open_db(path) as conn:
        yield SQLiteSource(conn, cache=cache)


def echo(result: dict, render, as_json: bool) -> None:
    if as_json:
        click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    else:
        click.echo(render(result), nl=False)


def report_of(db: str | None, label: str | None = None, since: str | None = None, until: str | None = None,
              cache: bool = True, prices: dict | None = None, by: str | None = None, slo: Any = None) -> dict:
    from specproxy.store.dataset import parse_time
    from specproxy.store.source import Window
    from specproxy.analyze.report_data import build_report, report_columns

    window = Window(label, parse_time(since), parse_time(until))
    with open_source(db, cache=cache) as store:
        data = store.load(window, report_columns(prices, by), server=True, context=True)
    return build_report(data, source=db_path(db), prices=prices, by=by, slo=slo)
