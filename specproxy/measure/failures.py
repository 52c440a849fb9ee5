"""Failures the measuring survives, made visible: counted per cause and logged at most once a minute each.

Why: measuring runs on traffic nobody chose, and a step that fails on one turn (a chat template that
raises, a tokenizer that chokes) must cost that figure only, never the turn or the proxy. The figure
then is null, never 0 or a guess; but a null that nobody hears of hides a bug. So each such failure
is noted here under a fixed phrase, its cause: the count goes to the state line (``Service.state``)
and the log says the first one of each cause, then once a minute with the count so far. The log
names the cause and the exception's type, never its message or the text: a message may quote the
prompt, and prompts may hold keys.

One process-wide table (``FAILURES``): measuring runs in worker threads, and the state line is the
process's; the counts only grow, so tests read the difference a turn makes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["FAILURES", "Failures"]

log = logging.getLogger("specproxy.measure")

LOG_EVERY_S = 60.0  # a cause that keeps failing is logged again at most this often


class Failures:
    """How many times each cause failed; ``note`` logs a cause's first failure, then at most once per
    ``log_every_s``."""

    def __init__(self, log_every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._log_every_s = log_every_s
        self._clock = clock

    def note(self, cause: str, exc: BaseException | None = None) -> None:
        """``cause``: a fixed phrase saying which step failed (never text from the turn); ``exc``: the
        exception, of which only the type is kept."""
        key = f"{cause} ({type(exc).__name__})" if exc is not None else cause
        now = self._clock()
        with self._lock:
            n = self._counts[key] = self._counts.get(key, 0) + 1
            last = self._logged_at.get(key)
            due = last is None or now - last >= self._log_every_s
            if due:
                self._logged_at[key] = now
        if due:
            log.warning("measuring: %s; %d so far (said at most once a minute)", key, n)

    def counts(self) -> dict[str, int]:
        """Failures so far, per cause."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


FAILURES = Failures()
