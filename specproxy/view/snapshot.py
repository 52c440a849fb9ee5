"""What one picture of the database shows: the report, the numbers behind its charts, the newest turns.

Why one function for the live page and ``report --html``: both draw the same window the same way, and
every figure comes from ``analyze`` (``build_report``, ``pictures``), read from the database as
``specproxy report`` reads it; nothing here computes a figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specproxy.analyze.pictures import pictures
from specproxy.analyze.report import REPORT_COLUMNS, build_report
from specproxy.analyze.slo import met
from specproxy.config import Slo
from specproxy.record import FIELD_NAMES
from specproxy.store.source import Source, Window

__all__ = ["RECENT_TURNS", "RECORD_FIELDS", "snapshot"]

RECENT_TURNS = 40
# a turn's record as the page shows it when clicked: every field but the stored texts (opt-in, and a
# page is easily shared)
RECORD_FIELDS = tuple(f for f in FIELD_NAMES if f not in ("prompt_text", "response_text"))


def snapshot(store: Source, *, source: str, label: str | None = None, since: float | None = None,
             until: float | None = None, recent: int = RECENT_TURNS, slo: Slo | None = None) -> dict[str, Any]:
    """The window's report (with ``slo``, its SLO section), pictures and newest turns, from one load of ``store``."""
    window = Window(label, since, until)
    data = store.load(window, REPORT_COLUMNS, server=True, context=True)
    report = build_report(data, source=source, slo=slo)
    turns = [dict(zip(RECORD_FIELDS, r)) for r in store.recent(window, RECORD_FIELDS, recent)]
    if slo is not None:  # each newest turn judged by the same rule as the report's share: not a stored field
        nan = float("nan")
        judged = met(slo, np.array([t["outcome"] for t in turns], dtype=object),
                     *(np.array([nan if t[f] is None else t[f] for t in turns], dtype=float)
                       for f in ("ttft_s", "decode_tps", "total_s")),
                     np.array([t["label"] for t in turns], dtype=object))
        for t, m in zip(turns, judged.tolist()):
            t["slo_met"] = None if m != m else bool(m)
    return {"report": report, "pictures": pictures(data.turns), "recent": turns}
