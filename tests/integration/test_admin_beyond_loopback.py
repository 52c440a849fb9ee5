"""The reserved pages asked for by a real client from an address that is not loopback, of the real
``specproxy serve``: in a private network namespace (``unshare -rn``, no privilege needed where user
namespaces are enabled), whose loopback device also carries 192.0.2.77 (a documentation address). Nothing
the test starts is reachable from outside that namespace. ``tests/netns_admin.py`` runs inside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REQUIRE_ENV = "SPECPROXY_REQUIRE_NETNS"
SETUP = "ip link set lo up && ip addr add 192.0.2.77/32 dev lo && exec \"$0\" \"$@\""


def _namespace_or_skip() -> list[str]:
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or "/usr/sbin/ip"
    why = None
    if unshare is None or not Path(ip).exists():
        why = "needs unshare (util-linux) and ip (iproute2)"
    else:
        probe = subprocess.run([unshare, "-rn", "sh", "-c", SETUP.replace('exec "$0" "$@"', "true")],
                               capture_output=True, env={**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin"})
        if probe.returncode != 0:
            why = f"no private network namespace here: {probe.stderr.decode(errors='replace').strip()}"
    if why:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{why} ({REQUIRE_ENV}=1 forbids skipping)", pytrace=False)
        pytest.skip(why)
    return [unshare, "-rn", "sh", "-c", SETUP]


@pytest.mark.parametrize("front", ["lane", "aiohttp"])
def test_beyond_loopback_the_pages_need_the_token_and_loopback_alone_does_not(front):
    cmd = _namespace_or_skip() + [sys.executable, str(TESTS / "netns_admin.py"), front]
    env = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin"}
    env = {k: v for k, v in env.items() if not k.startswith("SPECPROXY_")}
    done = subprocess.run(cmd, capture_output=True, timeout=120, env=env, cwd=TESTS.parent)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    seen = json.loads(done.stdout)
    far, near = "192.0.2.77", "127.0.0.1"
    pages = ("/_specproxy/", "/_specproxy/metrics")

    # listening beyond loopback with a token: only the token opens the pages, from anywhere
    tokened = seen["0.0.0.0 token=True"]
    for source in (far, near):
        for page in pages:
            assert tokened[f"{source} {page} none"] == 401, (source, page)
            assert tokened[f"{source} {page} wrong"] == 401, (source, page)
            assert tokened[f"{source} {page} bearer"] == 200, (source, page)
        assert tokened[f"{source} chat"] == 200  # traffic is forwarded as ever, token or not

    # listening beyond loopback without a token: nobody reads the pages, not even a loopback client
    open_ = seen["0.0.0.0 token=False"]
    assert {open_[f"{s} {p} {h}"] for s in (far, near) for p in pages for h in ("none", "wrong", "bearer")} == {401}
    assert open_[f"{far} chat"] == open_[f"{near} chat"] == 200

    # listening on loopback without a token: loopback clients read them; a client from another address does not
    local = seen["127.0.0.1 token=False"]
    for page in pages:
        assert local[f"{near} {page} none"] == 200
        assert local[f"{far} {page} none"] == 401
    assert local[f"{far} chat"] == 200

    assert seen["upstream paths"] == ["/v1/chat/completions"]  # the reserved prefix never reached it
