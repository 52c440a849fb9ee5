"""Whether the relay thread may poll for the server's next token: ``serve --cadence-poll auto|on|off``.

Why: at one stream, most of what a proxy adds to each token's wait is CPU wake-ups, and on a virtual
machine whose idle vCPUs halt, a wake-up is slow (``scripts/bench_overhead.py`` prints this machine's;
docs/performance.md, "Design figures"). An inference server decodes on a steady clock, so the relay thread learns it
and polls through a short window around the next token instead of sleeping through it (``_cadence.h``
says how the window is chosen, ``_pump.c`` how the thread waits). At most a tenth of the decode period
is spent polling, and only while at most ``POLL_MAX_TURNS`` streams are in flight.

Polling spends CPU, and a proxy must not take CPU from the server it measures (a llama.cpp server on
the same machine decodes on its cores). So ``auto``, the default, lets the thread poll only while the
machine has a whole core idle, sampled from ``/proc/stat`` once a second (``IdleCores``), and never
under a CPU quota (``cpu_quota``: a container's limit, which polling would spend); ``on`` lets it poll
regardless, ``off`` never. Without the relay thread (``relay = "python"``, or no C
compiler at install) there is nothing to poll and the setting does nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from specproxy.config import CADENCE_POLL_MODES
from specproxy.wire.os_thread import name_os_thread

__all__ = ["MODES", "CadenceGate", "IdleCores", "cpu_quota", "describe", "poll_stats"]

log = logging.getLogger("specproxy.cadence")

MODES = CADENCE_POLL_MODES
SAMPLE_S = 1.0
"""How often ``auto`` looks at the machine's idle time."""
IDLE_CORES_NEEDED = 1.0
"""``auto`` polls while at least this many cores' worth of the machine was idle over the last sample."""

try:
    from specproxy.wire import _relayc
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


def cpu_quota(cgroup_root: str | Path = "/sys/fs/cgroup",
              proc_cgroup: str | Path = "/proc/self/cgroup") -> float | None:
    """The CPU quota this process runs under, in cores (the tightest of its cgroup and their parents:
    cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``); None without one, or when it cannot be read.

    Why: ``/proc/stat`` shows the host's idle cores, which a container with a quota (a Kubernetes CPU
    limit) may not spend: polling would use up the proxy's own quota, and the throttling that follows
    would cost every stream far more than a wake-up."""
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "" and (root / "cgroup.controllers").exists():  # v2, unified
            quotas += _walk(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu, or with cpuacct as cpu,cpuacct
            for mount in (root / controllers, root / "cpu"):
                if mount.is_dir():
                    quotas += _walk(mount, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas set on the cgroup at ``path`` under ``mount`` and on each of its parents."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        q = read(mount.joinpath(*parts[:depth]))
        if q is not None:
            found.append(q)
    return found


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 or period <= 0 else quota / period


class CadenceGate:
    """Sets the relay thread's leave to poll from the mode, and in ``auto`` from the machine's idle cores.

    ``auto`` samples in a thread of its own, once a second (a read of ``/proc/stat``), never on the event
    loop. The leave is the process's (one relay thread per process): ``stop()`` withdraws it.
    """

    def __init__(self, mode: str, idle: IdleCores | None = None, *, interval_s: float = SAMPLE_S,
                 quota: float | None = None) -> None:
        """``quota``: the CPU quota in cores (``cpu_quota()``); under one, ``auto`` never polls."""
        if mode not in MODES:
            raise ValueError(f"cadence poll mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.quota = quota
        self.allowed = False
        self._idle = idle or IdleCores()
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.mode == "on":
            self._set(True)
        elif self.mode == "auto" and self.quota is None:
            self._thread = threading.Thread(target=self._watch, name="specproxy-cadence", daemon=True)
            self._thread.start()

    def update(self) -> None:
        """One sample: allow polling while at least ``IDLE_CORES_NEEDED`` cores were idle since the last
        (never under a CPU quota)."""
        idle = self._idle.sample()
        if idle is not None and not self._stopping.is_set():
            self._set(idle >= IDLE_CORES_NEEDED and self.quota is None)

    def stop(self) -> None:
        """Withdraw the leave; waits for the sampling thread (at most one sample's read)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._set(False)

    def _watch(self) -> None:
        name_os_thread()
        self._idle.sample()  # the first sample only sets the baseline
        while not self._stopping.wait(self._interval_s):
            self.update()

    def _set(self, allowed: bool) -> None:
        if allowed != self.allowed:
            log.debug("cadence poll %s", "allowed" if allowed else "withdrawn")
        self.allowed = allowed
        if _relayc is not None:
            _relayc.set_cadence_poll(allowed)


def describe(mode: str, relay_thread: bool, quota: float | None = None) -> str:
    """For ``serve``'s start-up line."""
    if not relay_thread:
        return "off (no relay thread)"
    if mode == "auto" and quota is not None:
        return f"auto, off: this process has a CPU quota of {quota:.2f} cores (--cadence-poll on to poll anyway)"
    return {"auto": "auto (polls for the next token while a core is idle)",
            "on": "on (polls for the next token)", "off": "off"}[mode]
