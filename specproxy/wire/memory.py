"""The process's memory budget: one count of the bytes specproxy holds on its clients' behalf.

Why one count for the process, not a limit per turn: each per-turn limit (``max_body_bytes``,
``max_measured_bytes``) is fine alone, but nothing bounded their sum, so enough clients at once (40
connections each sending 32 MB, 64 measured 16 MB streams, a backlog of large prompts waiting for the
tokenizer) could take the process past the machine's memory. What counts against it:

- a request body, for its declared length as soon as its head is read (the lane), or read by read as it
  arrives (aiohttp's front, a chunked body), until measuring is done with it (or the request is refused);
- every response read kept for measuring, from the read that keeps it until measuring is done with it:
  the relay thread charges it as it keeps it (``_pump.c``, lock-free), the Python relay in
  ``TurnRecorder.on_bytes``;
- a connection's pipelined requests, read while its exchange runs (``serve/lane.py``, ``charge``);
- records' texts and captured bodies waiting for the database (``store/writer.py``).

A request body that does not fit is refused (503) before it is read; a response read that does not fit
is relayed as ever and not kept (the record's ``measure_capped`` says why). The counter is an atomic in
the C extension when it is built (the relay thread takes from it without the interpreter lock), else a
Python int under a lock. One per process: every ``Proxy`` in it shares it.

Also here: the allocator settings that return a freed large body to the system at once (``release``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["charge", "default_budget", "give", "limit", "release_large_at_once", "set_limit", "take", "trim", "used"]

try:
    from specproxy.wire import _relayc
except ImportError:
    _relayc = None

_GIB = 1 << 30
MIN_BUDGET = 64 << 20


def default_budget(max_body_bytes: int) -> int:
    """A quarter of the memory this process may use (the machine's, or its cgroup's limit if lower), at
    most 2 GiB, and at least room for two of the largest request bodies (and 64 MiB)."""
    ram = _MACHINE_MEMORY
    return max(min(ram // 4, 2 * _GIB), 2 * max_body_bytes, MIN_BUDGET)


def _machine_memory() -> int:
    total = 8 * _GIB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


_MACHINE_MEMORY = _machine_memory()  # read once, at import: never a file read on the event loop

if _relayc is not None:
    take = _relayc.mem_take
    give = _relayc.mem_give
    used = _relayc.mem_used
    _set = _relayc.set_mem_limit
else:  # no C extension: the same count in Python (nothing but the loop and the measuring thread uses it)
    _lock = threading.Lock()
    _used = 0
    _limits = [0, 0]

    def take(n: int, small: bool = False) -> bool:
        global _used
        limit = _limits[1 if small else 0]
        with _lock:
            if limit > 0 and _used + n > limit:
                return False
            _used += n
            return True

    def give(n: int) -> None:
        global _used
        with _lock:
            _used -= n

    def used() -> int:
        return _used

    def _set(large: int, full: int) -> None:
        _limits[:] = [large, full]


def charge(n: int) -> None:
    """Charge ``n`` bytes already held, whatever the limit (bytes read that cannot be refused any more: a
    connection's pipelined requests); the holder stops taking more. ``give`` returns them."""
    give(-n)


_LIMIT = [0, 0]
SMALL_KEEP = 64 * 1024  # _pump.h's PUMP_SMALL_KEEP: a turn's first bytes kept are a small turn's


def set_limit(large: int, full: int) -> None:
    """The budget (``full``, bytes) and its share for large turns (``large``): ``take(n)`` stops at the
    share, ``take(n, small=True)`` at the whole (0: no limit). Set once at start; a test may set it again."""
    _LIMIT[:] = [large, full]
    _set(large, full)


def limit() -> tuple[int, int]:
    return _LIMIT[0], _LIMIT[1]


# --- returning freed memory to the system --------------------------------------------------------------

_M_MMAP_THRESHOLD = -3
_libc = None
try:
    _name = ctypes.util.find_library("c")
    if _name and os.uname().sysname == "Linux":
        _libc = ctypes.CDLL(_name)
        _libc.malloc_trim  # glibc only
except (OSError, AttributeError):
    _libc = None


def release_large_at_once() -> None:
    """Allocate every block over 256 KiB on its own pages, returned to the system when freed. glibc
    raises that threshold by itself after a large block is freed (up to 32 MiB), so a large request body
    would otherwise stay in the heap, counted in RSS, until a later allocation reuses it. Call once, at
    start (``serve``)."""
    if _libc is not None:
        try:
            _libc.mallopt(_M_MMAP_THRESHOLD, 256 * 1024)
        except AttributeError:
            pass


def trim() -> None:
    """Give the heaps' free pages back to the system (after measuring let go of large turns). Off the loop."""
    if _libc is not None:
        _libc.malloc_trim(0)
