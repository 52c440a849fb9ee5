"""The audit read from columns a group at a time gives the figures the per-turn audit gave, to the last
bit: ``audit_expected.json`` holds what the per-turn implementation (a Python dict per turn, lists per
figure; main at 416d05d) computed over ``audit_turns.varied_turns`` (several clients, sessions measured
out of start order, failed turns, turns without counts, tied prompts, priced and unpriced models), each
group's figures in full and its sessions' per-turn detail as a digest of its JSON (the detail is large;
on a mismatch, regenerate the file with the old code and diff it).

Regenerate (with the per-turn code on the path, from the repository root):
``PYTHONPATH=<old checkout> python tests/unit/test_audit_columns.py > tests/unit/audit_expected.json``

And ``specproxy audit`` reads the turns through the column cache as ``report`` does (``--cache``, the
default; ``--no-cache`` reads SQLite), which is what makes a month of turns seconds, not minutes.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))  # audit_turns, run as a script too

from audit_turns import PRICES, varied_turns  # noqa: E402

from specproxy.analyze import audit  # noqa: E402
from specproxy.analyze.audit import build_audit  # noqa: E402

EXPECTED = Path(__file__).with_name("audit_expected.json")
CASES = {"client-priced": ("client", True), "model": ("model", False), "session-priced": ("session", True)}
DUMP = orjson.OPT_SERIALIZE_NUMPY


def expectation(audit: dict) -> dict:
    """The audit as stored: every figure, each group's session detail as a digest of its JSON."""
    groups, digests = [], {}
    for c in audit["clients"]:
        groups.append({k: v for k, v in c.items() if k != "session_detail"})
        digests[c["client"]] = hashlib.sha256(orjson.dumps(c["session_detail"], option=DUMP)).hexdigest()
    figures = {**{k: v for k, v in audit.items() if k not in ("clients", "groups")}, "clients": groups}
    return orjson.loads(orjson.dumps({"audit": figures, "session_detail_sha256": digests}, option=DUMP))


def computed() -> dict:
    return {name: expectation(build_audit(varied_turns(), source="varied", by=by, prices=PRICES if priced else None))
            for name, (by, priced) in CASES.items()}


@pytest.mark.parametrize("pool", [False, True], ids=["in place", "medians on the pool"])
@pytest.mark.parametrize("case", CASES)
def test_the_audit_is_the_per_turn_audit_to_the_last_bit(case, pool, monkeypatch):
    if pool:  # every group's medians on the figures pool, as a month's large groups have them
        monkeypatch.setattr(audit, "PARALLEL_MIN", 1)
    want = orjson.loads(EXPECTED.read_bytes())[case]
    got = computed()[case]
    assert got["audit"] == want["audit"]
    assert got["session_detail_sha256"] == want["session_detail_sha256"]


def test_the_varied_turns_hold_what_the_audit_must_get_right():
    """The data exercises each case: without it the comparison above would hold trivially."""
    a = build_audit(varied_turns(), by="client", prices=PRICES)
    names = [c["client"] for c in a["clients"]]
    assert len(names) >= 4 and "(no User-Agent)" in names and "(none)" in names
    assert a["turns"] < len(varied_turns())  # failed turns and turns without counts are left out
    assert all(c["sessions"] for c in a["clients"]) and any(c["prefill_fit"] for c in a["clients"])
    assert any(c["cost"]["unpriced"] for c in a["clients"]) and any(c["cost"]["priced"] for c in a["clients"])


def test_audit_reads_through_the_column_cache(tmp_path):
    from specproxy.app.cli import main
    from specproxy.store.db import open_store

    db = tmp_path / "turns.db"
    conn = open_store(db)
    try:
        conn.execute("INSERT INTO turns (t_wall, outcome, prompt_tokens, prompt_system_tokens, prompt_tools_tokens, "
                     "prompt_history_tokens, prompt_new_tokens, client, measured) "
                     "VALUES (1e9, 'ok', 10, 4, 3, 2, 1, 'a', 1)")
        conn.commit()
    finally:
        conn.close()
    uncached = CliRunner().invoke(main, ["audit", "--db", str(db), "--json", "--no-cache"])
    assert uncached.exit_code == 0, uncached.output
    assert not (tmp_path / "turns.db.cache").exists()
    cached = CliRunner().invoke(main, ["audit", "--db", str(db), "--json"])
    assert cached.exit_code == 0, cached.output
    assert (tmp_path / "turns.db.cache").is_dir()
    assert cached.output == uncached.output and orjson.loads(cached.output)["turns"] == 1


if __name__ == "__main__":
    sys.stdout.buffer.write(orjson.dumps(computed(), option=DUMP | orjson.OPT_INDENT_2) + b"\n")
