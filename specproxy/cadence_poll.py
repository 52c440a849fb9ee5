"""Whether the relay thread may poll for the server's next token: ``serve --cadence-poll auto|on|off``.

Why: at one stream, most of what a proxy adds to each token's wait is CPU wake-ups, and on a virtual
machine whose idle vCPUs halt, a wake-up takes 55-145 µs at the median (``scripts/bench_overhead.py``
prints this machine's). An inference server decodes on a steady clock, so the relay thread learns it
and polls through a short window around the next token instead of sleeping through it (``_cadence.h``
says how the window is chosen, ``_pump.c`` how the thread waits). At most a tenth of the decode period
is spent polling, and only while at most ``POLL_MAX_TURNS`` streams are in flight.

Polling spends CPU, and a proxy must not take CPU from the server it measures (a llama.cpp server on
the same machine decodes on its cores). So ``auto``, the default, lets the thread poll only while the
machine has a whole core idle, sampled from ``/proc/stat`` once a second (``IdleCores``); ``on`` lets it
poll regardless, ``off`` never. Without the relay thread (``SPECPROXY_RELAY=loop|python``, or no C
compiler at install) there is nothing to poll and the setting does nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .config import CADENCE_POLL_MODES

__all__ = ["MODES", "CadenceGate", "IdleCores", "describe", "poll_stats"]

log = logging.getLogger("specproxy.cadence")

MODES = CADENCE_POLL_MODES
SAMPLE_S = 1.0
"""How often ``auto`` looks at the machine's idle time."""
IDLE_CORES_NEEDED = 1.0
"""``auto`` polls while at least this many cores' worth of the machine was idle over the last sample."""

try:
    from . import _relayc
except ImportError:
    _relayc = None


def poll_stats() -> dict[str, float]:
    """The relay thread's poll counters: windows polled, those a token arrived in, seconds spent."""
    if _relayc is None:
        return {"poll_windows": 0, "poll_hits": 0, "poll_s": 0.0}
    s = _relayc.pump_stats()
    return {"poll_windows": s["poll_windows"], "poll_hits": s["poll_hits"], "poll_s": s["poll_s"]}


def _cpu_times(text: str) -> tuple[int, int, int]:
    """(idle jiffies, all jiffies, CPUs) from the text of ``/proc/stat``."""
    idle = total = cpus = 0
    for line in text.splitlines():
        if line.startswith("cpu "):
            # user nice system idle iowait irq softirq steal [guest guest_nice: already in user and nice]
            values = [int(v) for v in line.split()[1:9]]
            idle = values[3] + values[4]
            total = sum(values)
        elif line.startswith("cpu") and line[3:4].isdigit():
            cpus += 1
    if cpus == 0 or total == 0:
        raise ValueError("no cpu lines")
    return idle, total, cpus


class IdleCores:
    """How many cores' worth of the machine was idle between two calls, from ``/proc/stat``."""

    def __init__(self, read: Callable[[], str] | None = None) -> None:
        self._read = read or _read_proc_stat
        self._last: tuple[int, int] | None = None

    def sample(self) -> float | None:
        """Idle cores since the previous sample; None on the first call or when /proc/stat is unreadable."""
        try:
            idle, total, cpus = _cpu_times(self._read())
        except (OSError, ValueError):
            self._last = None
            return None
        last, self._last = self._last, (idle, total)
        if last is None or total <= last[1]:
            return None
        return cpus * (idle - last[0]) / (total - last[1])


def _read_proc_stat() -> str:
    with open("/proc/stat", encoding="ascii") as f:
        return f.read()


class CadenceGate:
    """Sets the relay thread's leave to poll from the mode, and in ``auto`` from the machine's idle cores.

    ``auto`` samples in a thread of its own, once a second (a read of ``/proc/stat``), never on the event
    loop. The leave is the process's (one relay thread per process): ``stop()`` withdraws it.
    """

    def __init__(self, mode: str, idle: IdleCores | None = None, *, interval_s: float = SAMPLE_S) -> None:
        if mode not in MODES:
            raise ValueError(f"cadence poll mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.allowed = False
        self._idle = idle or IdleCores()
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.mode == "on":
            self._set(True)
        elif self.mode == "auto":
            self._thread = threading.Thread(target=self._watch, name="specproxy-cadence", daemon=True)
            self._thread.start()

    def update(self) -> None:
        """One sample: allow polling while at least ``IDLE_CORES_NEEDED`` cores were idle since the last."""
        idle = self._idle.sample()
        if idle is not None and not self._stopping.is_set():
            self._set(idle >= IDLE_CORES_NEEDED)

    def stop(self) -> None:
        """Withdraw the leave; waits for the sampling thread (at most one sample's read)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._set(False)

    def _watch(self) -> None:
        self._idle.sample()  # the first sample only sets the baseline
        while not self._stopping.wait(self._interval_s):
            self.update()

    def _set(self, allowed: bool) -> None:
        if allowed != self.allowed:
            log.debug("cadence poll %s", "allowed" if allowed else "withdrawn")
        self.allowed = allowed
        if _relayc is not None:
            _relayc.set_cadence_poll(allowed)


def describe(mode: str, relay_thread: bool) -> str:
    """For ``serve``'s start-up line."""
    if not relay_thread:
        return "off (no relay thread)"
    return {"auto": "auto (polls for the next token while a core is idle)",
            "on": "on (polls for the next token)", "off": "off"}[mode]
