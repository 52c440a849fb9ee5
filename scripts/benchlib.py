"""What the benchmark scripts share (they sit side by side in scripts/): the machine line every one prints,
and where a step they time is looked up."""

from __future__ import annotations

import importlib
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def owner_of(module: str | object, path: str) -> tuple[object, str]:
    """Where ``path`` ("Class.method", or a function's name) of ``module`` (a module's name, or an object)
    is looked up when called, and its last name: what to ``setattr`` to wrap it."""
    owner = importlib.import_module(module) if isinstance(module, str) else module
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name
