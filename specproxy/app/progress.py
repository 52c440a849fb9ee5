"""What a benchmark shows while it runs: a ``rich`` progress display on a terminal, nothing otherwise.

Why quiet off a terminal: a benchmark run from a script or CI is read for its report, and a progress
bar redrawn into a log file is noise. On a terminal it says what runs (arm, instance, concurrency,
repeat), turns done out of planned, and the time left.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol

__all__ = ["BenchProgress", "make_progress"]


class BenchProgress(Protocol):
    def start(self, total: int | None, *, rounds: int = 0, round_s: float | None = None) -> None: ...
    def phase(self, text: str) -> None: ...
    def begin_round(self) -> None: ...
    def advance(self, n: int = 1) -> None: ...
    def stop(self) -> None: ...


class Quiet:
    def start(self, total: int | None, *, rounds: int = 0, round_s: float | None = None) -> None:
        pass

    def phase(self, text: str) -> None:
        pass

    def begin_round(self) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def stop(self) -> None:
        pass


class _Left:
    """The time left. Rounds of a fixed length (``--duration``): the rounds not yet ended times their length,
    less the running round's elapsed part (restarts and warm-ups not counted, so it is a lower bound).
    Rounds of a fixed number of turns: rich's estimate from the turns' pace so far."""

    def __init__(self, rounds: int, round_s: float | None) -> None:
        self.rounds, self.round_s = rounds, round_s
        self.begun = 0
        self.round_t0: float | None = None

    def begin(self) -> None:
        self.begun += 1
        self.round_t0 = time.monotonic()

    def seconds(self, task) -> float | None:
        if self.round_s is None:
            return task.time_remaining
        running = 0.0 if self.round_t0 is None else min(time.monotonic() - self.round_t0, self.round_s)
        return max(self.rounds - max(self.begun - 1, 0), 0) * self.round_s - running


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(max(seconds, 0) + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RichProgress:
    """One line: what runs (arm, instance, concurrency, repeat), a bar, turns done / planned, the time
    elapsed and the time left, each named."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
        from rich.text import Text

        left = self._left = _Left(0, None)

        class Turns(ProgressColumn):
            def render(self, task) -> Text:
                done = int(task.completed)
                return Text(f"{done}/{int(task.total)} turns" if task.total is not None else f"{done} turns")

        class Times(ProgressColumn):
            max_refresh = 0.5

            def render(self, task) -> Text:
                return Text(f"elapsed {_clock(task.elapsed)}, left {_clock(left.seconds(task))}")

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), Turns(), Times(),
                                  console=console or Console(stderr=True), transient=True)
        self._task = None

    def start(self, total: int | None, *, rounds: int = 0, round_s: float | None = None) -> None:
        self._left.rounds, self._left.round_s = rounds, round_s
        self._progress.start()
        self._task = self._progress.add_task("starting", total=total)

    def phase(self, text: str) -> None:
        if self._task is not None:
            self._progress.update(self._task, description=text)

    def begin_round(self) -> None:
        self._left.begin()

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
