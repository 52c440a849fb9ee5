"""What every command of the command line shares: one-line errors, the ``--db`` option, reading a database.

Why apart from ``cli.py``: ``bench_cli.py`` adds its commands to ``cli.py``'s group and uses these too;
here, both import them and neither imports the other back (``python -m specproxy.app.cli`` runs ``cli``
as ``__main__``, and a second copy of it, imported by ``bench_cli``, would get the commands).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import click
import orjson

from specproxy.config import Config, load_config
from specproxy.errors import SpecproxyError

__all__ = ["DEFAULTS", "db_option", "db_path", "echo", "friendly", "open_db", "report_of", "setting", "shown",
           "slo_option"]


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

slo_option = click.option(
    "--slo", "slo", default=None,
    help="Judge every turn by a service-level objective, e.g. ttft=2s,tpot=50ms,e2e=30s (any of them; ms or s): "
         "the share of turns that met it, with its interval, and goodput (docs/metrics.md, Goodput under an SLO)")


def db_path(db: str | None) -> str:
    return db or load_config(overrides={}).db


def open_db(db: str | None):
    """The database for reading: every way it can be the wrong file is one line (store.open_existing)."""
    from specproxy.store.db import open_existing

    return open_existing(db_path(db))


def echo(result: dict, render, as_json: bool) -> None:
    if as_json:
        click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    else:
        click.echo(render(result), nl=False)


def report_of(db: str | None, label: str | None = None, since: str | None = None, until: str | None = None,
              cache: bool = True, slo: Any = None) -> dict:
    from specproxy.store.dataset import parse_time
    from specproxy.store.source import Window
    from specproxy.store.sqlite_source import SQLiteSource
    from specproxy.analyze.report import REPORT_COLUMNS, build_report

    window = Window(label, parse_time(since), parse_time(until))
    with open_db(db) as conn:
        data = SQLiteSource(conn, cache=cache).load(window, REPORT_COLUMNS, server=True, context=True)
    return build_report(data, source=db_path(db), slo=slo)
