"""Whether a turn met a service-level objective: the rule, written once, over arrays of turns.

Why in measuring, below both its callers: ``analyze/slo.py`` asks it of stored rows (``report --slo``,
``compare``, ``bench``, the live page), and ``serve/own_metrics.py`` of the records a running proxy
counts on ``/metrics`` (``specproxy_slo_turns``), off the forwarding path; one rule, so the page, the
report and Prometheus can never disagree about a turn. docs/metrics.md ("Goodput under an SLO") is the
contract.

The rule (``met``), per measured turn: 1 (met), 0 (not met) or NaN (not judged).

* ``tpot`` is the stream's decode time per delivered output token after the first chunk: ``decode_s``
  over (``completion_tokens`` - the first chunk's tokens), which is ``1 / decode_tps`` exactly, so the
  SLO and the report's decode speed are one figure read two ways.
* A turn that failed (any outcome but ``ok``, ``client_abort`` and ``shutdown``: an error answer, no
  answer, a truncated body, a stalled client, a proxy error) did not meet it.
* A turn the client left (``client_abort``) or specproxy's own shutdown cut (``shutdown``) is not judged:
  neither the server's doing, and its figures are partial.
* An objective can give labels their own (``ttft=2s; batch: e2e=60s``): a turn is judged by its label's,
  else by the one for every turn; a turn neither applies to is not judged.
* A completed turn meets it when every bound the objective sets has its figure at or under it. A figure
  it lacks (no tpot on a non-streamed turn, a one-chunk answer or without a tokenizer; a non-streamed
  turn's TTFT is its whole response time, as stored)
  leaves it not judged, unless another figure already exceeds its bound: then it did not meet it.
* Judged by one bound alone (``figure``: what ``/metrics`` counts per objective), a turn is judged as if
  its objective set only that one; a turn whose objective sets none on it is not judged by it.
"""

from __future__ import annotations

import numpy as np

from specproxy.config.slo import Slo  # not the package: its settings import socket, which measuring may not

__all__ = ["FIGURES", "NOT_JUDGED_OUTCOMES", "met", "tpot_s"]

# a turn cut by its client or by specproxy's shutdown is not the server's doing: not judged
NOT_JUDGED_OUTCOMES = ("client_abort", "shutdown")
# the bounds an objective may set, as ``met``'s ``figure`` names them
FIGURES = ("ttft_s", "tpot_s", "e2e_s")


def tpot_s(decode_tps: np.ndarray) -> np.ndarray:
    """Seconds per output token after the first chunk: 1 / ``decode_tps`` (NaN where it is unknown or 0)."""
    d = np.asarray(decode_tps, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.isfinite(d) & (d > 0), 1.0 / d, np.nan)


def met(slo: Slo, outcome: np.ndarray, ttft_s: np.ndarray, decode_tps: np.ndarray, total_s: np.ndarray,
        labels: np.ndarray | None = None, figure: str | None = None) -> np.ndarray:
    """Per turn: 1.0 met the SLO, 0.0 did not, NaN not judged (the module docstring's rule). ``labels``:
    each turn's label, for an objective with labels of their own (``Slo.for_label``); a turn no
    objective applies to is not judged. ``figure`` (``ttft_s``, ``tpot_s`` or ``e2e_s``): judged by that
    one bound alone, as if the objective set no other (a turn whose objective sets none on it is not
    judged); None: by all of them."""
    outcome = np.asarray(outcome, dtype=object)
    n = len(outcome)
    bounds = {name: np.full(n, np.nan) for name in ("ttft_s", "tpot_s", "e2e_s")}
    applies = np.zeros(n, dtype=bool)
    if slo.labels and labels is not None:
        labels = np.asarray(labels, dtype=object)
        groups = [(slo.for_label(label), np.fromiter((x == label for x in labels), bool, n))
                  for label in set(labels.tolist())]
    else:
        groups = [(slo.for_label(None), np.ones(n, dtype=bool))]
    for own, at in groups:
        if own is None or (figure is not None and getattr(own, figure) is None):
            continue
        applies |= at
        for name, b in bounds.items():
            if (figure is None or name == figure) and getattr(own, name) is not None:
                b[at] = getattr(own, name)
    ok = outcome == "ok"
    judged = applies & ~np.isin(outcome, NOT_JUDGED_OUTCOMES)
    figures = {"ttft_s": np.asarray(ttft_s, dtype=float), "tpot_s": tpot_s(decode_tps),
               "e2e_s": np.asarray(total_s, dtype=float)}
    over = np.zeros(n, dtype=bool)
    lacking = np.zeros(n, dtype=bool)
    for name, values in figures.items():
        bound = bounds[name]
        set_ = np.isfinite(bound)
        known = np.isfinite(values)
        with np.errstate(invalid="ignore"):
            over |= set_ & known & (values > bound)
        lacking |= set_ & ~known
    out = np.where(judged & ok & ~over & ~lacking, 1.0, np.nan)
    out[judged & ((ok & over) | ~ok)] = 0.0
    return out
