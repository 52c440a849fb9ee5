"""``scripts/turn_path.py``: one streamed chat turn's path from socket to row, traced in a real proxy.

The script runs ``specproxy serve`` under its probe in front of the package's scripted upstream and
traces the third turn on a kept-alive connection. Here its report is read back against what the code
is: the front, the exchange and the pool are entered, the record is built off the loop and put in the
store's queue by the measuring thread itself. The reading of a trace (``path_of``) is checked on its
own with the call lists of both designs, the current one and one that handed records back to the loop.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from turn_path import path_of  # noqa: E402

from specproxy.wire.relay_thread import THREAD_BUILT  # noqa: E402


def test_a_traced_turn_enters_the_front_the_exchange_and_the_pool_and_reaches_its_row(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "turn_path.py")], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, modules, threads = proc.stdout.strip().splitlines()
    m = re.match(r"this checkout: (\d+) serve and wire modules entered, (\d+) Python calls into them; "
                 r"(\d+) specproxy modules in all$", head)
    assert m, head
    entered = dict(re.findall(r"(\S+) \((\d+)\)", modules))
    assert int(m.group(1)) == len(entered) and int(m.group(2)) == sum(map(int, entered.values()))
    for module in ("serve/lane.py", "serve/proxy.py", "wire/exchange.py", "wire/pool.py", "wire/upstream.py",
                   "serve/measuring.py"):
        assert module in entered, (module, modules)
    assert "serve/aiohttp_front.py" not in entered  # a plain request stays on the lane
    relay = "relay thread (C) -> MainThread -> " if THREAD_BUILT else ""
    assert threads.strip() == (f"threads from socket to row: MainThread -> {relay}specproxy-measure -> "
                               f"specproxy-writer ({4 if THREAD_BUILT else 2} hand-offs)")


def _calls(put_by: str) -> list[tuple[str, str, str]]:
    return [
        ("MainThread", "specproxy/serve/lane.py", "Lane.data_received"),
        ("MainThread", "specproxy/wire/relay_thread.py", "TurnSink.start"),
        ("MainThread", "specproxy/wire/relay_thread.py", "TurnSink._collect"),
        ("MainThread", "specproxy/serve/lane.py", "Lane._next"),
        ("specproxy-measure", "specproxy/measure/build.py", "build_record"),
        (put_by, "specproxy/store/writer.py", "Writer.put"),
        ("specproxy-writer", "specproxy/store/writer.py", "Writer._write"),
        ("MainThread", "specproxy/serve/own_metrics.py", "OwnMetrics.record"),
    ]


def test_the_hand_offs_follow_the_record_whichever_thread_puts_it_in_the_store():
    direct = path_of(_calls("specproxy-measure"))
    assert direct.threads == ["MainThread", "relay thread (C)", "MainThread", "specproxy-measure", "specproxy-writer"]
    assert direct.hand_offs == 4
    assert direct.modules == {"specproxy/serve/lane.py": 2, "specproxy/wire/relay_thread.py": 2,
                              "specproxy/serve/own_metrics.py": 1}
    assert direct.calls == 5 and len(direct.all_modules) == 5
    through_loop = path_of(_calls("MainThread"))  # the records went back to the loop before the writer
    assert through_loop.threads[3:] == ["specproxy-measure", "MainThread", "specproxy-writer"]
    assert through_loop.hand_offs == 5
    on_loop = path_of([c for c in _calls("specproxy-measure") if "TurnSink" not in c[2]])  # relayed in Python
    assert on_loop.threads == ["MainThread", "specproxy-measure", "specproxy-writer"]
