"""``scripts/bench_measure.py --phases``: measuring one turn phase by phase, at a tiny scale.

The script checks its own setup (each synthetic turn's build equals the reference's); here the phases'
table is read back: every phase ran as often as a turn takes it, and the wrappers that time them are
gone once the table is made (the builder's phases are the plain functions again). Nothing is timed.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import owner_of  # noqa: E402
from measure_phases import PHASES, _timed_phases  # noqa: E402


def test_a_short_run_times_every_phase_of_the_build(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_measure.py"), "--turns", "3", "--chunks", "12",
         "--repeats", "1", "--phases"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("phases of the build, µs per turn") == 2  # both shapes (plain, t_send)
    lines = proc.stdout.splitlines()
    for _, path, what, _ in PHASES:
        rows = [ln for ln in lines if ln.rstrip().endswith(" a turn") and f"   {path}, " in ln]
        assert len(rows) == 2, (path, proc.stdout[-3000:])
        for row in rows:
            us = float(row.split(":", 1)[1].split()[0])
            per_turn = float(row.rsplit(", ", 1)[1].split()[0])
            assert us >= 0 and per_turn >= 1.0, row  # every phase runs in every turn's build
    events = [ln for ln in lines if "   _Gather.event, " in ln]
    # a role chunk, the first content chunk (the template's), the last with usage, [DONE]: read one by one
    assert all(float(ln.rsplit(", ", 1)[1].split()[0]) >= 3 for ln in events), events
    assert sum("the rest of the build" in ln for ln in lines) == 2
    # the header names the interpreter and its kind, as this test's own (the same interpreter) maps it
    with open("/proc/self/maps") as f:
        kind = "libpython shared" if any("libpython" in line for line in f) else "libpython in the executable"
    assert f", Python {platform.python_version()}, {kind};" in lines[0], lines[0]


def test_the_wrappers_are_taken_out_after_timing():
    from specproxy.measure.tokens import load_tokenizer

    tok = load_tokenizer("tiktoken:o200k_base")

    def current():
        got = {}
        for module, path, _, _ in PHASES:
            owner, name = owner_of(type(tok) if module is None else module, path)
            got[path] = (getattr(owner, name), isinstance(owner, type) and name in owner.__dict__)
        return got

    before = current()
    spent: dict = {}
    calls: dict = {}
    with _timed_phases(tok, spent, calls):
        during = current()
        assert all(during[p][0] is not before[p][0] for p in before)  # every phase is wrapped meanwhile
    assert current() == before and set(spent) == set(calls) == set(before)


def test_a_baseline_builds_the_same_turns_with_another_checkouts_package(tmp_path):
    # this checkout against itself: its .venv (what `.ci/run` and the README's setup make) is the baseline's
    venv_python = ROOT / ".venv" / "bin" / "python"
    assert venv_python.exists(), "the README's setup makes .venv in the checkout"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_measure.py"), "--baseline", str(ROOT), "--pairs", "2",
         "--turns", "3", "--chunks", "12", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(" this    : plain ") == 2 and proc.stderr.count(" baseline: plain ") == 2, proc.stderr
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in proc.stdout.splitlines() if ln.startswith("| ")}
    for shape in ("plain", "t_send"):
        this, base, ratio = (cell.strip() for cell in rows[shape].strip("| ").split(" | ")[1:])
        assert float(this) > 0 and float(base) > 0, rows[shape]
        assert float(ratio.split()[0]) > 0 and "–" in ratio, rows[shape]
