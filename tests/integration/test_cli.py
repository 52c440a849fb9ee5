"""The real command line, run as a user runs it (subprocesses of the installed entry point)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from specproxy.record import FIELD_NAMES
from specproxy.app.fake_upstream import Script

ROOT = Path(__file__).resolve().parents[2]
SPECPROXY = [sys.executable, "-m", "specproxy.app.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECPROXY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    return db, run("demo", "--db", str(db), "--turns", "3")


def test_demo_prints_a_real_report(demo_db):
    db, proc = demo_db
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for section in ("What users got", "Prompt make-up", "By concurrency", "Whole-turn speedup"):
        assert section in out
    assert "15 turns (15 ok)" in out  # 3 turns alone + 3 turns x 4 clients
    # the scripted server has no prefix cache, and says so before its counters' 0% shows in the report
    [first] = [line for line in proc.stderr.splitlines() if line.startswith("demo: scripted upstream at")]
    assert "(no prefix cache: it prefills every prompt whole)" in first
    assert "were found (hit rate 0.0%)" in out


def test_demo_serves_its_live_page_and_stays_until_ctrl_c(tmp_path):
    """The demo prints the live page's address and serves it from the proxy it runs; with --stay the
    page keeps every turn of the demo on it until Ctrl-C, and then the report is printed."""
    import http.client
    import re
    from urllib.parse import urlsplit

    db = tmp_path / "demo.db"
    proc = subprocess.Popen([*SPECPROXY, "demo", "--db", str(db), "--turns", "2", "--stay"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        printed, page = [], None
        for line in proc.stderr:  # ends with the process: bounded by the demo itself
            printed.append(line)
            if "the live page stays at" in line:
                page = re.search(r"(http://\S+/_specproxy/)", line).group(1)
                break
        assert page is not None, "".join(printed)
        assert any(f"live page {page}" in line for line in printed), printed  # said at the start, as serve does
        where = urlsplit(page)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        conn.request("GET", "/_specproxy/")
        resp = conn.getresponse()
        assert resp.status == 200 and "text/html" in resp.getheader("Content-Type")
        assert "specproxy live" in resp.read().decode()
        # the events carry each new picture: read them until one shows all 10 turns (2 alone, 2 x 4 clients)
        conn.request("GET", "/_specproxy/events")
        resp = conn.getresponse()
        assert resp.status == 200
        shown = None
        for raw in resp:  # a read timeout (30 s) bounds the wait
            if raw.startswith(b"data: "):
                shown = int(re.search(rb'data-figure=\\"turns\\" data-value=\\"(\d+)', raw).group(1))
                if shown == 10:
                    break
        assert shown == 10
        conn.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "10 turns (10 ok)" in out and "Traceback" not in err


def test_report_json_and_export_agree(demo_db):
    db, _ = demo_db
    rep = run("report", "--db", str(db), "--json")
    assert rep.returncode == 0, rep.stderr
    r = json.loads(rep.stdout)
    assert r["turns"] == 15
    assert r["user"]["tokens_per_chunk"]["median"] > 1.5  # the demo server drafts: chunks are not tokens
    assert r["prompt"]["prompt_tools_tokens"]["median"] > 1000
    assert {row["content_class"] for row in r["by_content_class"]} == {"prose", "code"}
    levels = [row["concurrency"] for row in r["by_concurrency"]]
    # four clients starting together are measured at 1, 2, 3 and 4 in flight: the real operating point
    assert levels[0] == "1" and levels[-1] == "3-4" and r["by_concurrency"][0]["read"] == "per-stream"
    lines = run("export", "--db", str(db)).stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 15 and set(rows[0]) == set(FIELD_NAMES)
    assert all(row["completion_tokens"] > 0 and row["ttft_s"] > 0 for row in rows)
    c = run("export", "--db", str(db), "--format", "csv").stdout
    table = list(csv.reader(io.StringIO(c)))
    assert table[0] == list(FIELD_NAMES) and len(table) == 16


def test_report_filters_by_label(demo_db):
    db, _ = demo_db
    r = json.loads(run("report", "--db", str(db), "--json", "--label", "no-such-arm").stdout)
    assert r["turns"] == 0 and r["user"]["ttft_s"]["n"] == 0 and r["user"]["ttft_s"]["median"] is None


def test_an_empty_window_says_so_and_what_the_database_holds(demo_db):
    """Not "no turns recorded yet" and "start serve with --tokenizer" when the database has turns."""
    db, _ = demo_db
    out = run("report", "--db", str(db), "--label", "no-such-arm", "--since", "2020-01-01").stdout
    assert "no turns in this window (label no-such-arm, since 2020-01-01 00:00:00 UTC); the database holds 15 turns (" in out
    assert "no turns recorded yet" not in out and "tokenizer" not in out
    labels = json.loads(run("report", "--db", str(db), "--json").stdout)["labels"]
    assert f"; no turn has label no-such-arm (its labels are {', '.join(labels)})" in out  # as compare says
    later = run("report", "--db", str(db), "--until", "1000").stdout
    assert "no turns in this window (until 1970-01-01 00:16:40 UTC); the database holds 15 turns" in later
    r = json.loads(run("report", "--db", str(db), "--json", "--label", "no-such-arm").stdout)
    assert r["window"]["label"] == "no-such-arm" and r["database_turns"]["n"] == 15
    assert r["database_turns"]["first_t_wall"] <= r["database_turns"]["last_t_wall"]


def test_an_empty_database_has_no_turns_recorded_yet(tmp_path):
    from specproxy.store.db import open_store

    open_store(tmp_path / "empty.db").close()
    out = run("report", "--db", str(tmp_path / "empty.db"), "--label", "x").stdout
    assert "no turns recorded yet" in out and "the database holds" not in out and "tokenizer" not in out
    r = json.loads(run("report", "--db", str(tmp_path / "empty.db"), "--json").stdout)
    assert r["turns"] == 0 and r["database_turns"]["n"] == 0


def test_report_cache_and_no_cache_agree(demo_db, tmp_path):
    import shutil

    db = tmp_path / "copy.db"
    shutil.copyfile(demo_db[0], db)
    cache = tmp_path / "copy.db.cache"
    plain = run("report", "--db", str(db), "--json", "--no-cache")
    assert plain.returncode == 0, plain.stderr
    assert not cache.exists()  # --no-cache reads SQLite only and writes nothing
    for _ in range(2):  # builds the cache, then reads it
        cached = run("report", "--db", str(db), "--json")
        assert cached.returncode == 0, cached.stderr
        assert cached.stdout == plain.stdout
        assert (cache / "manifest.json").exists()
    text = run("report", "--db", str(db), "--label", "demo")
    assert text.stdout == run("report", "--db", str(db), "--label", "demo", "--no-cache").stdout
    for cmd in (["report"], ["compare", "x"], ["audit"]):
        assert "--no-cache" in run(*cmd, "--help").stdout
    audit = run("audit", "--db", str(db), "--json")
    assert audit.returncode == 0 and audit.stdout == run("audit", "--db", str(db), "--json", "--no-cache").stdout
    a = run("compare", "demo", "--negative-control", "--db", str(db), "--json")
    b = run("compare", "demo", "--negative-control", "--db", str(db), "--json", "--no-cache")
    assert a.returncode == 0 and a.stdout == b.stdout


@pytest.mark.parametrize("args, message", [
    (["serve"], "no upstream"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--tokenizer", "bogus:x"], "unknown kind"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--tokenizer", "hf:/no/such/dir"], "not found"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--tokenizer", "tiktoken:nope"], "Unknown encoding nope"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--db", "/no/such/dir/x.db"], "does not exist"),
    (["serve", "--upstream", "not a url"], "not an http"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--header-timeout", "0"], "header_timeout_s must be positive"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--scrape-retention-days", "-1"], "scrape_retention_days must be >= 0"),
    (["report", "--db", "/no/such/file.db"], "does not exist"),
    (["report", "--db", "/dev/null", "--since", "yesterday-ish"], "cannot read time"),
])
def test_bad_input_is_one_clear_line(args, message):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specproxy: error:") and message in lines[0], proc.stderr


def test_an_unknown_relay_setting_is_one_clear_line():
    proc = subprocess.run([*SPECPROXY, "serve", "--upstream", "http://127.0.0.1:9", "--port", "0"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, "SPECPROXY_RELAY": "fast"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["specproxy: error: relay must be one of thread, python, not 'fast'"], proc.stderr


def _start_up_line(tmp_path, *args: str) -> str:
    """The line `serve` prints once it listens (the one that says where it forwards); then SIGTERM, and a
    clean exit is asserted."""
    proc = subprocess.Popen([*SPECPROXY, "serve", "--port", "0", "--db", str(tmp_path / "t.db"), *args],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for _ in range(50):  # bounded: start-up prints a few lines at most before these
            lines.append(proc.stderr.readline())
            if not lines[-1] or "point your client's base URL" in lines[-1]:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    return "".join(lines)


def test_serve_says_how_a_chat_template_is_counted(hf_dir, tmp_path):
    line = _start_up_line(tmp_path, "--upstream", "http://127.0.0.1:9", "--tokenizer", f"hf:{hf_dir}")
    assert f"tokenizer hf:{hf_dir} (chat template, renders counted piece by piece);" in line, line
    assert "PyTorch" not in line  # transformers' import-time advice: specproxy needs no model (issue #31)


def test_serve_on_all_interfaces_gives_a_url_a_client_can_use(tmp_path):
    """``--host 0.0.0.0`` is where it listens, not an address to connect to (issue #31)."""
    text = _start_up_line(tmp_path, "--upstream", "http://127.0.0.1:9", "--host", "0.0.0.0")
    port = re.search(r"forwarding http://127\.0\.0\.1:(\d+) ->", text).group(1)
    assert f"point your client's base URL at http://127.0.0.1:{port}/v1 (listening on all interfaces, 0.0.0.0:{port}" \
        in text, text
    assert "0.0.0.0:" + port + "/v1" not in text


def test_serve_says_where_a_client_path_goes(tmp_path):
    """A base URL copied from a server's docs (with /v1): the start-up line shows the mapping, no /v1/v1."""
    line = _start_up_line(tmp_path, "--upstream", "http://127.0.0.1:9/v1")
    assert ("(client /v1/chat/completions -> http://127.0.0.1:9/v1/chat/completions; "
            "/chat/completions -> http://127.0.0.1:9/chat/completions)") in line, line


def test_serve_records_and_drains_on_sigterm(make_stack, tmp_path, tiktoken_tok):
    stack = make_stack()  # used for its fake upstream only
    stack.upstream.script = Script(pieces=["A", " real", " answer"], interval_s=0.01)
    db = tmp_path / "serve.db"
    proc = subprocess.Popen([*SPECPROXY, "serve", "--upstream", stack.upstream.url, "--port", "0", "--db", str(db),
                             "--tokenizer", "tiktoken:o200k_base"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "forwarding http://" in line:
                url = line.split("forwarding ")[1].split(" ")[0]
                assert "requests read by the lane" in line, line
        assert url, "serve did not say where it listens"

        async def chat(n):
            async with aiohttp.ClientSession() as c:
                for _ in range(n):
                    async with c.post(url + "/v1/chat/completions", json={
                            "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
                        assert r.status == 200
                        await r.read()

        stack.run(chat(5))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    rows = [json.loads(x) for x in run("export", "--db", str(db)).stdout.splitlines()]
    assert len(rows) == 5 and all(r["completion_tokens"] == 3 for r in rows)


def test_every_option_shows_at_most_one_default():
    """Each command's --help, as a user reads it: no option says two defaults (one written by hand beside
    the one read from Config), which would leave the reader to guess which holds."""
    import re

    from specproxy.app.cli import main

    commands = sorted(main.commands)
    assert "serve" in commands
    for name in commands:
        proc = run(name, "--help")
        assert proc.returncode == 0, (name, proc.stderr)
        text = " ".join(proc.stdout.split())
        doubled = re.findall(r"\[default:[^\]]*\] *\[default:[^\]]*\]", text)
        assert doubled == [], (name, doubled)
