"""``specproxy_slo_turns``: the turns a running proxy judged against ``serve --slo``, by objective and result.

Why judged in batches, at scrape time: the rule is ``measure/slo_rule.py``'s ``met`` (the one the report,
``compare``, ``bench`` and the live page ask of stored rows), written over arrays. Asking it of one turn
at a time on the event loop would cost tens of microseconds of numpy calls per turn there; instead a
record costs the loop one append of six values (``add``), and the judging runs over every turn heard
since, in the thread that formats the page (``family``: the admin's scrape, off the loop). Unscraped, a
thread of its own judges them once ``FOLD_AT`` have waited, so memory stays bounded and the loop never
judges (one such thread at a time; none while a scrape judges).

Series: the per-turn labels of the proxy's other counters (model, operation, API, outcome), then
``objective`` (``ttft``, ``tpot``, ``e2e``: judged by that bound alone; ``all``: by every bound of the
turn's objective, which is what the report's share counts), ``slo_label`` (the label whose own objective
judged the turn, as ``--slo`` names it; empty for the objective of every turn: a client's other labels
never become series) and ``met`` (``true``, ``false``). A turn not judged (left by its client, cut by
shutdown, lacking the figure) is in no series.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
from prometheus_client.core import CounterMetricFamily

from specproxy.config import Slo
from specproxy.measure.slo_rule import met
from specproxy.record import Record

__all__ = ["FOLD_AT", "OBJECTIVES", "SloCounts"]

# (the ``objective`` label, ``met``'s figure): each bound alone, then all of them
OBJECTIVES = (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"), ("all", None))
FOLD_AT = 4096  # turns waiting to be judged before a thread of their own judges them (nobody scraped meanwhile)
MET = {1.0: "true", 0.0: "false"}


class SloCounts:
    """Counts of judged turns per series; ``add`` on the loop, ``family`` from any thread."""

    def __init__(self, slo: Slo, labels: tuple[str, ...]) -> None:
        """``labels``: the names of the per-turn key ``add`` is given (``own_metrics.LABELS``)."""
        self.slo = slo
        self.labels = labels
        self._own = {name for name, _ in slo.labels}
        self._waiting: deque[tuple] = deque()  # appends (the loop) and poplefts (a judge) are atomic
        self._lock = threading.Lock()  # one judge at a time: the counts are added to under it
        self.counts: dict[tuple[str, ...], int] = {}

    def add(self, key: tuple[str, ...], r: Record) -> None:
        """One turn the store took: waits to be judged (see the module's docstring)."""
        self._waiting.append((key, r.outcome, r.ttft_s, r.decode_tps, r.total_s, r.label))
        if len(self._waiting) >= FOLD_AT and self._lock.acquire(blocking=False):
            try:
                threading.Thread(target=self._judge_and_release, name="specproxy-slo", daemon=True).start()
            except RuntimeError:  # no thread to be had (the interpreter is ending): the next scrape judges them
                self._lock.release()

    def _judge_and_release(self) -> None:
        """In a thread of its own, the lock ``add`` took for it."""
        try:
            self._judge()
        finally:
            self._lock.release()

    def _judge(self) -> None:
        """Judge every turn waiting (under the lock): each objective's ``met``, added to the counts."""
        batch = [self._waiting.popleft() for _ in range(len(self._waiting))]
        if not batch:
            return
        keys, outcome, ttft, tps, total, label = zip(*batch)
        figures = (np.array(outcome, dtype=object), _floats(ttft), _floats(tps), _floats(total))
        labels = np.array(label, dtype=object)
        # each turn's series but for the objective and the result, numbered: the counting is then bincounts
        numbered: dict[tuple[str, ...], int] = {}
        series = np.array([numbered.setdefault((*key, lb if lb in self._own else ""), len(numbered))
                           for key, lb in zip(keys, label)], dtype=np.int64)
        names = list(numbered)
        counts = self.counts
        for objective, figure in OBJECTIVES:
            result = met(self.slo, *figures, labels, figure=figure)
            judged = np.isfinite(result)
            for value, word in MET.items():
                tally = np.bincount(series[judged & (result == value)], minlength=len(names))
                for i in np.flatnonzero(tally).tolist():
                    key = (*names[i][:-1], objective, names[i][-1], word)
                    counts[key] = counts.get(key, 0) + int(tally[i])

    def family(self) -> CounterMetricFamily:
        """The counts, with every turn heard so far judged first."""
        with self._lock:
            self._judge()
            series = list(self.counts.items())
        fam = CounterMetricFamily("specproxy_slo_turns", f"Measured turns the store took judged against the "
                                  f"SLO ({self.slo.text}): per objective (ttft, tpot, e2e alone; all: every "
                                  "bound), whether they met it", labels=(*self.labels, "objective", "slo_label", "met"))
        for key, n in series:
            fam.add_metric(list(key), n)
        return fam


def _floats(values: tuple) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)
