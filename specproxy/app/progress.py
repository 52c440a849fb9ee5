"""What a benchmark shows while it runs: a ``rich`` progress display on a terminal, nothing otherwise.

Why quiet off a terminal: a benchmark run from a script or CI is read for its report, and a progress
bar redrawn into a log file is noise. On a terminal it says what runs (arm, instance, concurrency,
repeat), turns done out of planned, and the time left.
"""

from __future__ import annotations

import sys
from typing import Protocol

__all__ = ["BenchProgress", "make_progress"]


class BenchProgress(Protocol):
    def start(self, total: int | None) -> None: ...
    def phase(self, text: str) -> None: ...
    def advance(self, n: int = 1) -> None: ...
    def stop(self) -> None: ...


class Quiet:
    def start(self, total: int | None) -> None:
        pass

    def phase(self, text: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def stop(self) -> None:
        pass


class RichProgress:
    """One bar: the running block's description, turns done / planned, elapsed and time left."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("turns"), TimeElapsedColumn(), TextColumn("left"),
                                  TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._task = None

    def start(self, total: int | None) -> None:
        self._progress.start()
        self._task = self._progress.add_task("starting", total=total)

    def phase(self, text: str) -> None:
        if self._task is not None:
            self._progress.update(self._task, description=text)

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)

    def stop(self) -> None:
        self._progress.stop()


def make_progress(force: bool | None = None) -> BenchProgress:
    """``rich`` when stderr is a terminal (or ``force``), else quiet."""
    if force if force is not None else sys.stderr.isatty():
        return RichProgress()
    return Quiet()
