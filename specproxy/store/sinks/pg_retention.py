"""Deleting old rows from the fleet's PostgreSQL (``specproxy prune --db postgresql://...``).

Why whole partitions: ``turns`` is partitioned by UTC day (``pg_migrations.py``), so the days wholly
before the cut are dropped, each at once and without a row-by-row DELETE (whose dead rows a large
table would have to vacuum away); only the day the cut falls in loses rows one by one. Each day is its
own transaction, so proxies shipping meanwhile wait at most one drop.
"""

from __future__ import annotations

import datetime

import psycopg
from psycopg import sql

from specproxy.store.sinks import SinkError
from specproxy.store.sinks.postgres import DAY_S, connect, one_line

__all__ = ["day_of", "prune_postgres"]


def day_of(partition: str) -> int | None:
    """The UTC day number of a ``turns_YYYYMMDD`` partition (None for another name)."""
    try:
        day = datetime.datetime.strptime(partition.removeprefix("turns_"), "%Y%m%d").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None
    return int(day.timestamp()) // DAY_S


def prune_postgres(url: str, before: float, *, turns: bool) -> dict[str, int]:
    """Delete scrapes (and with ``turns``, turns and their counter joins) with ``t_wall < before``; the
    counts: ``scrapes``, ``turns``, ``turn_counters``, ``partitions`` (days dropped whole)."""
    conn = connect(url)
    done = {"scrapes": 0, "turns": 0, "turn_counters": 0, "partitions": 0}
    try:
        with conn.transaction():
            done["scrapes"] = conn.execute("DELETE FROM scrapes WHERE t_wall < %s", (before,)).rowcount
        if turns:
            names = [r[0] for r in conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'turns'::regclass ORDER BY c.relname")]
            for name in names:
                day = day_of(name)
                if day is None or (day + 1) * DAY_S > before:
                    continue
                part = sql.Identifier(name)
                with conn.transaction():
                    done["turn_counters"] += conn.execute(sql.SQL(
                        "DELETE FROM turn_counters c USING {} t WHERE c.turn_id = t.id").format(part)).rowcount
                    done["turns"] += conn.execute(sql.SQL("SELECT count(*) FROM {}").format(part)).fetchone()[0]
                    conn.execute(sql.SQL("DROP TABLE {}").format(part))
                done["partitions"] += 1
            with conn.transaction():  # the day the cut falls in
                done["turn_counters"] += conn.execute(
                    "DELETE FROM turn_counters c USING turns t WHERE c.turn_id = t.id AND t.t_wall < %s",
                    (before,)).rowcount
                done["turns"] += conn.execute("DELETE FROM turns WHERE t_wall < %s", (before,)).rowcount
    except psycopg.errors.UndefinedTable:
        raise SinkError(f"{url}: no specproxy tables there (no proxy has shipped to it yet)") from None
    except psycopg.Error as exc:
        raise SinkError(f"{url}: {one_line(exc)}") from None
    finally:
        conn.close()
    return done
