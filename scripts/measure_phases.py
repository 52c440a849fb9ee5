"""Measuring one turn, phase by phase: ``bench_measure.py --phases``.

Why: measuring's cost is paid once a turn, in many steps none of which is large; the per-chunk totals
of ``bench_measure.py`` say how much, not where. This times each phase of ``build_record`` with
``thread_time`` (wrappers installed for the timing pass only, where the build looks each phase up,
and taken out after), so that a change to one phase can be read in µs per turn.
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager

from benchlib import owner_of

__all__ = ["PHASES", "phases_table"]

# (module, attribute path, what the phase is, nested in the phase above it)
PHASES = (
    ("specproxy.measure.build", "read_request", "the request parsed", False),
    ("specproxy.measure.build", "read_response", "the response read", False),
    ("specproxy.measure.response_body", "join_reads", "its framing joined (C)", True),
    ("specproxy.measure.fast_texts", "_Gather.event", "its events read one by one (orjson, read_chunk)", True),
    ("specproxy.measure.fast_texts", "content_template", "its template derived (inside an event's read)", True),
    ("specproxy.measure.build", "count_completion", "the completion counted (tiktoken)", False),
    (None, "count_prompt", "the prompt counted (the tokenizer's memos)", False),
    ("specproxy.measure.prefix", "PrefixTracker.observe", "the prompt compared with the session's last", False),
    ("specproxy.measure.build", "content_class_of", "the content class", False),
    ("specproxy.measure.build", "client_of", "the client named", False),
    ("specproxy.measure.build", "session_of", "the session named", False),
    ("specproxy.measure.build", "tool_names", "the tools named", False),
    ("specproxy.measure.build", "_record_of", "the Record made", False),
)


@contextmanager
def _timed_phases(tok, spent: dict[str, float], calls: dict[str, int]):
    """Every phase wrapped (``tok``'s class for ``count_prompt``), its thread_time added to ``spent`` and
    its calls to ``calls``."""
    undo = []
    for module, path, _, _ in PHASES:
        owner, name = owner_of(type(tok) if module is None else module, path)
        own = not isinstance(owner, type) or name in owner.__dict__  # else inherited: deleted afterwards
        fn = getattr(owner, name)
        spent.setdefault(path, 0.0)
        calls.setdefault(path, 0)

        def timed(*args, _fn=fn, _path=path, **kwargs):
            t0 = time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_path] += time.thread_time() - t0
                calls[_path] += 1

        setattr(owner, name, timed)
        undo.append((owner, name, fn, own))
    try:
        yield
    finally:
        for owner, name, fn, own in reversed(undo):
            if own:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)


def phases_table(turns: list, tok, time_builds, repeats: int) -> str:
    """µs per turn of each phase, the median over ``repeats`` timed passes over ``turns``, beside the
    build's whole time with and without the wrappers (``time_builds(turns, tok, True)``: seconds)."""
    per_pass: list[dict[str, float]] = []
    wrapped, bare = [], []
    calls: dict[str, int] = {}
    for _ in range(repeats):
        spent: dict[str, float] = {}
        gc.collect()
        gc.disable()  # as bench_measure times every build
        try:
            bare.append(time_builds(turns, tok, True))
            with _timed_phases(tok, spent, calls):
                wrapped.append(time_builds(turns, tok, True))
        finally:
            gc.enable()
        per_pass.append(spent)
    n = len(turns)
    us = {path: statistics.median(p[path] for p in per_pass) / n * 1e6 for _, path, _, _ in PHASES}
    total = statistics.median(wrapped) / n * 1e6
    top = sum(us[path] for _, path, _, nested in PHASES if not nested)
    L = [f"{'phases of the build, µs per turn':>34}  (median of {repeats} passes; the build "
         f"{total:.0f} µs a turn with the wrappers, {statistics.median(bare) / n * 1e6:.0f} without)"]
    for _, path, what, nested in PHASES:
        label = f"… {what}" if nested else what
        L.append(f"{label:>52}: {us[path]:7.1f}   {path}, {calls[path] / (n * repeats):.1f} a turn")
    L.append(f"{'the rest of the build':>52}: {total - top:7.1f}")
    return "\n".join(L)
