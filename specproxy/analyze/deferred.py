"""The report's independent figures computed on a small thread pool, put back in their places at the end.

Why: a report computes ~50 summaries (a partition of up to every turn's value each) and a few other
figures that depend on nothing but their own columns, and numpy's partition, sort and reductions release
the GIL on float arrays. On two cores, two of them run at once while the main thread goes on selecting
the next cells. Each figure is the same function of the same values wherever it runs, so the report is
the same to the last bit, and in the same order: a figure's place in the report is taken when it is
asked for (a ``Future`` there), and ``resolved`` puts each result in that place.

A figure computed on the pool computes the figures it asks for in place (``_in_place``): no worker
waits for a figure queued behind it.

One worker per core the process may run on (``os.sched_getaffinity``), at most ``MAX_WORKERS``; on one
core there is no pool and every figure is computed where it is asked for. At most ``MAX_PENDING``
figures wait at once: the main thread waits for the oldest before asking for more, so the columns a
waiting figure holds (a cell's selected values) stay bounded at 10M turns.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

__all__ = ["MAX_PENDING", "MAX_WORKERS", "figures_in_parallel", "later", "part", "resolved", "workers"]

MAX_WORKERS = 2
MAX_PENDING = 8


def _in_place(fn: Callable[..., Any], *args: Any) -> Any:
    _POOL.set(None)  # in this worker's own context: whatever it asks for, it computes
    return fn(*args)


class _Pool:
    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._pending: deque[Future] = deque()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        while len(self._pending) >= MAX_PENDING:
            self._pending.popleft().result()
        future = self._executor.submit(_in_place, fn, *args)
        self._pending.append(future)
        return future


# the pool of the report being built in this context (None: compute in place): a context variable, so
# that the report's helpers need no pool argument and a report built elsewhere at the same time has its own
_POOL: contextvars.ContextVar[_Pool | None] = contextvars.ContextVar("figures_pool", default=None)


def workers() -> int:
    """Threads for the figures: the cores this process may run on, at most ``MAX_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@contextlib.contextmanager
def figures_in_parallel() -> Iterator[None]:
    """Within it, ``later`` runs figures on the pool (one worker: in place). The caller ``resolved``s what
    it built before leaving: leaving waits for every figure still running."""
    n = workers()
    if n < 2:
        yield
        return
    with ThreadPoolExecutor(n, thread_name_prefix="figures") as executor:
        token = _POOL.set(_Pool(executor))
        try:
            yield
        finally:
            _POOL.reset(token)


def later(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: on the pool when ``figures_in_parallel`` is open here (a Future in its place until
    ``resolved``), else at once. ``fn`` must read only its arguments (it runs beside the main thread)."""
    pool = _POOL.get()
    return fn(*args) if pool is None else pool.submit(fn, *args)


class _Part:
    """``whole[key]`` of a figure still on the pool: a place in the report for one item of it."""

    __slots__ = ("whole", "key")

    def __init__(self, whole: Future, key: Any):
        self.whole, self.key = whole, key


def part(whole: Any, key: Any) -> Any:
    """``whole[key]``, where ``whole`` is what ``later`` returned: when it is still on the pool, a place that
    ``resolved`` fills with that item (several places may share one figure: one table's cells, computed
    in one pass)."""
    return _Part(whole, key) if isinstance(whole, Future) else whole[key]


def resolved(tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples) with every Future replaced by its result, keys in their order."""
    if isinstance(tree, Future):
        return resolved(tree.result())
    if isinstance(tree, _Part):
        return resolved(tree.whole.result()[tree.key])
    if isinstance(tree, dict):
        return {k: resolved(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [resolved(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(resolved(v) for v in tree)
    return tree
