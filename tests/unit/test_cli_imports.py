"""What a read command imports: a report on an SQLite file starts no event loop and needs neither the
PostgreSQL driver nor the Prometheus parser (together ~0.25 s of a report's start, more than its whole
analysis at 1M turns). Checked in a fresh interpreter, on a database the store's own writer made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specproxy.app.fake_upstream import make_record
from specproxy.store.writer import Writer

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("asyncio", "psycopg", "prometheus_client", "aiohttp", "uvloop")
RUN = """
import json, runpy, sys
sys.argv = ["specproxy", *sys.argv[1:]]
try:
    runpy.run_module("specproxy.app.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _run(*args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


def test_report_and_compare_on_an_sqlite_file_import_no_loop_driver_or_parser(tmp_path):
    db = tmp_path / "t.db"
    w = Writer(db)
    for i in range(40):
        w.put(make_record(seed=i / 40, t_wall=1_790_000_000.0 + i, label="a" if i % 2 else "b"))
    w.close()
    got, out = _run("report", "--db", str(db), "--json")
    assert got == {"code": 0, "loaded": []} and json.loads(out)["turns"] == 40
    got, _ = _run("compare", "a", "b", "--db", str(db))
    assert got == {"code": 0, "loaded": []}
