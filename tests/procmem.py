"""A process's resident memory as Linux keeps it in ``/proc/PID/status``, for the memory tests.

Why one module: the memory tests (one large response, the memory budget, a large body not held, a thousand
stalled clients) read the same two figures, and each read them its own way (bytes or KiB, its own parse).
``VmRSS`` is what the process holds now, ``VmHWM`` its peak since it started or since ``reset_peak``;
both in bytes here.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["PeakRss", "memory", "reset_peak"]


def memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` (this process by default), in bytes; a process that has exited
    but not been reaped has neither."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int | str = "self") -> None:
    """Reset ``pid``'s peak resident set (VmHWM) to what it holds now (Linux: clear_refs 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class PeakRss:
    """Samples another process's RSS every 50 ms on a thread of its own, until stopped: ``first`` is its
    RSS when sampling began, ``stop`` returns the largest seen (bytes)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = self.first = memory(pid).get("VmRSS", 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, memory(self.pid).get("VmRSS", 0))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak
