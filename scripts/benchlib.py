"""What the benchmark scripts share (they sit side by side in scripts/): the machine line every one prints,
the interpreter it names, and where a step they time is looked up."""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys


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


_BUILD = """
import platform
try:
    with open("/proc/self/maps") as f:
        shared = any("libpython" in line for line in f)
except OSError:
    shared = None
print(platform.python_version() + {True: ", libpython shared", False: ", libpython in the executable"}.get(shared, ""))
"""


def python_build(executable: str | None = None) -> str:
    """The interpreter that runs specproxy, as a benchmark names it: its version, and whether the
    interpreter sits in a shared libpython (built ``--enable-shared``) or is linked into the executable
    (as Debian's python3). Why: one machine's measuring build cost 15% less CPU under Debian's python3.11
    than under a pyenv build with a shared libpython and no ``--enable-optimizations`` (docs/performance.md,
    "Design figures"): more than most changes a before/after shows. Asked of a child process of
    ``executable`` (default: this one's interpreter), whose memory maps are the interpreter's alone."""
    try:
        out = subprocess.run([executable or sys.executable, "-c", _BUILD], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return platform.python_version() if executable is None else "?"
    return out.stdout.strip() or "?"


def owner_of(module: str | object, path: str) -> tuple[object, str]:
    """Where ``path`` ("Class.method", or a function's name) of ``module`` (a module's name, or an object)
    is looked up when called, and its last name: what to ``setattr`` to wrap it."""
    owner = importlib.import_module(module) if isinstance(module, str) else module
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name
