"""``specproxy bench`` with restarts, and every way a run can go wrong (a server that errors, a bad replay
line, a restart command that fails or hangs, a server that never comes back or goes away mid-round, a
wrong port, no tokenizer): one line on stderr, exit status 2, with what was measured before it kept.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
from pathlib import Path

import pytest

from benchkit import bench_with_second_line, one_line_error, specproxy, upstream_thread, workload
from specproxy.app.fake_upstream import FakeUpstream, Script

__all__ = ["upstream_thread"]  # a fixture the tests take by name


def restart_script(tmp_path: Path, port: int, *, fail_on: int | None = None, start: bool = True) -> Path:
    """A restart command that (re)starts a fake upstream process on ``port``: exit 3 on instance
    ``fail_on``; with ``start=False`` it kills the server and starts none."""
    server = tmp_path / "server.py"
    server.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from specproxy.app.fake_upstream import FakeUpstream, Script
        async def main():
            up = FakeUpstream(Script(pieces=["x"] * 6, interval_s=float(sys.argv[1])))
            await up.start({port})
            await asyncio.Event().wait()
        asyncio.run(main())
    """))
    pid = tmp_path / "pid"
    script = tmp_path / "restart.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        if [ -f {pid} ]; then kill "$(cat {pid})" 2>/dev/null; n=0
          while {{ grep -qv ') Z ' /proc/"$(cat {pid})"/stat || (exec 3<>/dev/tcp/127.0.0.1/{port}); }} 2>/dev/null \\
            && [ $n -lt 200 ]; do sleep 0.02; n=$((n+1)); done
          rm -f {pid}; fi  # until it exited and its port takes no connection (kill -0 also waits for the reaping)
        {f'if [ "$SPECPROXY_INSTANCE" = "{fail_on}" ]; then echo "no GPU left for arm $1" >&2; exit 3; fi' if fail_on else ''}
        {'' if start else 'exit 0'}
        case "$1" in fast) iv=0.001;; *) iv=0.004;; esac
        {sys.executable} {server} $iv > {tmp_path}/server.log 2>&1 &
        echo $! > {pid}
    """))
    script.chmod(0o755)
    return script


@pytest.fixture
def restarts(tmp_path):
    from real.server import free_port

    port = free_port()
    yield tmp_path, port
    pid = tmp_path / "pid"
    if pid.exists():  # the last fake this test's script started
        import os
        import signal

        try:
            os.kill(int(pid.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass



def test_restarts_interleave_arms_and_stamp_each_instance(restarts):
    tmp_path, port = restarts
    script = restart_script(tmp_path, port)
    db = tmp_path / "r.db"
    proc = specproxy("bench", "--upstream", f"http://127.0.0.1:{port}", "--from", str(workload(tmp_path)),
                     "--db", str(db), "--tokenizer", "tiktoken:o200k_base", "--label", "slow,fast",
                     "--restart-cmd", f"{script} {{arm}}", "--instances", "2", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["restarts_unverified"] == []  # each restart seen to start a new process
    conn = sqlite3.connect(db)
    order = [row[0] for row in conn.execute(
        "SELECT instance_id FROM turns GROUP BY instance_id ORDER BY min(t_request)")]
    conn.close()
    assert [i.rsplit("-", 2)[1:] for i in order] == [["slow", "1"], ["fast", "1"], ["fast", "2"], ["slow", "2"]]
    compare = json.loads(specproxy("compare", "slow", "fast", "--db", str(db), "--json").stdout)
    assert compare["instances_a"] == compare["instances_b"] == 2


def test_a_failing_restart_command_is_one_line_and_keeps_the_first_blocks(restarts):
    tmp_path, port = restarts
    script = restart_script(tmp_path, port, fail_on=2)
    db = tmp_path / "r.db"
    proc = specproxy("bench", "--upstream", f"http://127.0.0.1:{port}", "--from", str(workload(tmp_path)),
                     "--db", str(db), "--label", "a,b", "--restart-cmd", f"{script} {{arm}}", "--instances", "2",
                     "--repeats", "1")
    one_line_error(proc, "restart command for arm b (instance 2) exited with status 3: no GPU left for arm b")
    assert "bench arm a:" in proc.stdout and "bench arm b:" in proc.stdout  # the blocks before it, summarised
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 12  # and stored
    conn.close()


def test_a_server_that_never_comes_back_is_one_line(restarts):
    tmp_path, port = restarts
    script = restart_script(tmp_path, port, start=False)
    proc = specproxy("bench", "--upstream", f"http://127.0.0.1:{port}", "--from", str(workload(tmp_path)),
                     "--db", str(tmp_path / "r.db"), "--restart-cmd", str(script), "--ready-timeout", "1")
    one_line_error(proc, f"the server at http://127.0.0.1:{port} (arm bench, instance 1) was not ready within 1 s",
                   "connection refused")
    # the wait was said as it began: what, where, for which block
    assert f"waiting for the server at http://127.0.0.1:{port} to be ready (arm bench, instance 1" in proc.stderr


def test_a_wrong_port_without_a_restart_command_fails_at_once(tmp_path, refused):
    """Nothing is starting a server: a refused connection is an error now, not a 300 s silent wait. (The
    port is held bound, so no other test's server can take it meanwhile.)"""
    import time

    port = refused
    t0 = time.monotonic()
    proc = specproxy("bench", "--upstream", f"http://127.0.0.1:{port}", "--from", str(workload(tmp_path)),
                     "--db", str(tmp_path / "w.db"), "--tokenizer", "tiktoken:o200k_base", timeout=240)
    one_line_error(proc, f"nothing answers at http://127.0.0.1:{port} (arm bench, instance 1): connection refused")
    assert time.monotonic() - t0 < 150  # at once (seconds, with the start-up), not after a 300 s wait


def test_a_restart_that_leaves_the_same_server_running_is_refused(tmp_path, upstream_thread):
    """A restart command that does not restart (here `true`) would make every block the same process and
    compare's interval "over instances" a fiction: bench sees the same start time and refuses."""
    up = upstream_thread()
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(tmp_path / "s.db"),
                     "--restart-cmd", "true", "--instances", "3", "--label", "a,b", "--ready-timeout", "10")
    one_line_error(proc, "the restart command for arm a (instance 1) returned, but the server at",
                   "is the same process as before it", "start time")
    assert up.sent == []  # nothing measured on a server that was not restarted


def test_a_hung_restart_command_is_killed_with_its_children(tmp_path, refused):
    """The command runs in its own session; on the timeout the whole group is killed, not just the shell
    (a child it started, here a sleep, would otherwise live on). The upstream's port refuses connections
    throughout (held bound: a port merely free a moment ago was once taken by another process's server,
    which bench then read)."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    proc = specproxy("bench", "--upstream", f"http://127.0.0.1:{refused}", "--from", str(workload(tmp_path)),
                     "--db", str(tmp_path / "h.db"), "--restart-cmd", f"sleep 300 & echo $! > {pid_file}; wait",
                     "--ready-timeout", "1")
    one_line_error(proc, "restart command for arm bench (instance 1) did not return within 1 s")
    child = int(pid_file.read_text())

    def alive() -> bool:  # a killed child is gone, or a zombie until its new parent reaps it
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    still = alive()
    if still:
        os.kill(child, 9)
    assert not still, "the restart command's child outlived the timeout"


def test_a_server_that_goes_away_mid_round_ends_the_round(tmp_path, upstream_thread):
    """The fake stops listening when its 6th request arrives: the round stops sending after a few failures
    in a row (not thousands over its --duration), says so in one line, and keeps what completed."""
    import asyncio
    import time

    holder: list[FakeUpstream] = []
    count = [0]

    def script(_req: dict) -> Script:
        count[0] += 1
        if count[0] == 6:  # the event: the server goes away (its listening socket and idle connections close)
            asyncio.get_running_loop().create_task(holder[0].close())
        return Script(pieces=["a", " b", " c"])

    up = upstream_thread(script)
    holder.append(up)
    db = tmp_path / "g.db"
    t0 = time.monotonic()
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                     "--duration", "200", "--concurrency", "2", "--repeats", "1", "--warmup", "0",
                     "--tokenizer", "tiktoken:o200k_base", "--label", "gone")
    one_line_error(proc, "went away", "10 requests in a row could not reach it", "completed turns are kept")
    assert time.monotonic() - t0 < 100  # the round did not run out its 200 s (seconds, with the start-up)
    conn = sqlite3.connect(db)
    outcomes = dict(conn.execute("SELECT outcome, count(*) FROM turns WHERE label = 'gone' GROUP BY outcome"))
    conn.close()
    assert outcomes.get("ok", 0) >= 4  # the turns before it, stored
    failed = sum(v for k, v in outcomes.items() if k != "ok")
    # the run of failures that ended it, and what was in flight as the server closed (a loaded machine may
    # see a few more of those cut mid-answer): a few dozen at most, never the thousands a 20 s round sends
    assert 10 <= failed <= 30, outcomes
    assert "bench arm gone:" in proc.stdout  # and summarised


def test_without_a_tokenizer_bench_and_roofline_say_what_is_missing(tmp_path, upstream_thread):
    up = upstream_thread()
    db = tmp_path / "n.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                     "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "no --tokenizer" in line]
    assert len(lines) == 1 and "tok/s show '-'" in lines[0] and "TTFT" in lines[0], proc.stderr
    assert "no tokenizer: tokens were not counted" in proc.stdout
    # roofline on those turns: what is missing is their token counts; on another label, the turns themselves
    roofline = ("roofline", "--active-params", "8e9", "--bits", "4", "--bandwidth-gbs", "273", "--db", str(db))
    one_line_error(specproxy(*roofline), "streamed turns", "none with a token count", "without a tokenizer")
    held = json.loads(specproxy("report", "--db", str(db), "--json").stdout)["turns"]
    error = one_line_error(specproxy(*roofline, "--label", "other"), "no turns labelled other",
                           f"(it holds {held} turns in all)")
    assert held and "tokenizer" not in error.replace(str(db), "DB")
    # asked for none: not told it gave none (issue #31); the table still says what is missing
    chosen = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                       "--repeats", "1", "--tokenizer", "none")
    assert chosen.returncode == 0 and "no --tokenizer" not in chosen.stderr, chosen.stderr
    assert "no tokenizer: tokens were not counted" in chosen.stdout
    # no per-stream figure: the intervals are over the rounds of the aggregate alone, not "0 rounds"
    assert " 0 rounds" not in chosen.stdout and " 0 turns" not in chosen.stdout, chosen.stdout


def test_roofline_says_what_is_missing_for_the_measured_figure(tmp_path):
    """A database with no turns gets "no turns", not a tokenizer it may well have had; --label without
    --db (which roofline reads only when given) is refused rather than ignored."""
    from specproxy.store.db import open_store

    db = tmp_path / "empty.db"
    open_store(db).close()
    args = ("roofline", "--active-params", "8e9", "--bits", "4", "--bandwidth-gbs", "273")
    error = one_line_error(specproxy(*args, "--db", str(db)), f"{db}: no turns", "nothing measured")
    assert "tokenizer" not in error.replace(str(db), "DB")
    one_line_error(specproxy(*args, "--label", "spec"), "--label", "give --db")
    proc = specproxy(*args)  # the ceiling alone, as before
    assert proc.returncode == 0 and "at most 68.2 forward passes/s" in proc.stdout, proc.stderr


def test_a_server_that_errors_is_one_line(tmp_path, upstream_thread):
    up = upstream_thread(Script(status=500, error_body=b'{"error": {"message": "out of memory"}}'))
    work = workload(tmp_path)
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(tmp_path / "e.db"))
    one_line_error(proc, "the warm-up request", "HTTP 500", "out of memory")
    db = tmp_path / "e2.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--warmup", "0")
    one_line_error(proc, "none of 6 requests succeeded", "HTTP 500")
    conn = sqlite3.connect(db)  # the failed turns are kept, as failures
    assert conn.execute("SELECT outcome, count(*) FROM turns GROUP BY outcome").fetchall() == [("upstream_error", 6)]
    conn.close()


@pytest.mark.parametrize(("line", "needle"), [
    (b'{"model": "m"}', "line 2: not a request"),
    (b'[1, 2]', "line 2: not a request"),
    (b'{"messages": [', "line 2: not JSON"),
    (b'{"path": "/v1/embeddings", "body": "{}"}', "line 2: path '/v1/embeddings' is not one specproxy measures"),
])
def test_a_bad_replay_line_is_one_line_naming_it(tmp_path, upstream_thread, line, needle):
    up = upstream_thread()
    proc, work = bench_with_second_line(tmp_path, up, line, "bad.jsonl")
    one_line_error(proc, f"{work}:2", needle.split(": ", 1)[1] if ": " in needle else needle)
    assert up.sent == []  # nothing was sent
