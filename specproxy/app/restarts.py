"""Restarting the inference server between a benchmark's blocks, and knowing when it is ready again.

Why: the same configuration varies 15-19% from one server start to the next, so an A/B that ran each
arm in one process cannot tell the setting from the restart (docs/statistics.md). Running each arm in
several processes, interleaved (A B B A ...), gives ``compare`` an interval over instances. specproxy
does not know how your server is started, so the user's command does it: it must stop the running
server and start the arm's (in the background) and return; its exit status is checked. Then the
server's readiness is polled: llama.cpp answers ``/health`` 503 while the model loads, vLLM and
SGLang answer ``/health`` 200 once ready; a server without ``/health`` is ready when ``/v1/models``
answers 200. And an interval "over instances" is only true if each block ran on a new process: after
each restart, bench compares what the server says about itself (``new_process``: start time, build,
models, counters) with what it said before, and refuses a restart that left the same process running.

The command's output goes to a file, never a pipe: a server started in the background inherits the
command's stdout, and a pipe would then stay open (and the wait never end) for the server's life.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from specproxy.config import child_environment
from specproxy.errors import SpecproxyError
from specproxy.observe.counters import restart_reason
from specproxy.observe.instance import START_HEADER, Instance, float_or_none, identify_instance, identity_changed
from specproxy.observe.server_metrics import Snapshot, parse_exposition

__all__ = ["Look", "RestartError", "look", "new_process", "restart_command", "run_restart", "wait_ready"]

POLL_S = 0.2  # between readiness polls: a server's start is not an event we can wait on
COUNTERS = ("generation_tokens_total", "prompt_tokens_total")  # a new process starts them from zero


class RestartError(SpecproxyError):
    """The restart command failed, or the server never became ready."""


def restart_command(template: str, arm: str, instance: int) -> str:
    """The command for one block: ``{arm}`` and ``{instance}`` in ``template`` replaced (shell-quoted)."""
    return template.replace("{arm}", shlex.quote(arm)).replace("{instance}", str(instance))


def run_restart(command: str, arm: str, instance: int, timeout_s: float) -> None:
    """Run the restart command in a shell (blocking: call in a thread); RestartError unless it exits 0 within
    ``timeout_s``. The environment also carries SPECPROXY_ARM and SPECPROXY_INSTANCE."""
    env = child_environment({"SPECPROXY_ARM": arm, "SPECPROXY_INSTANCE": str(instance)})
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        except OSError as exc:
            raise RestartError(f"restart command for arm {arm} could not start: {exc.strerror or exc}") from None
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RestartError(f"restart command for arm {arm} (instance {instance}) did not return within "
                               f"{timeout_s:g} s (it must start the server in the background and exit)") from None
        if status != 0:
            out.seek(0)
            tail = [line for line in out.read().decode("utf-8", "replace").splitlines() if line.strip()][-1:]
            said = f": {tail[0].strip()[:200]}" if tail else ""
            raise RestartError(f"restart command for arm {arm} (instance {instance}) exited with status {status}{said}")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the hung command and everything it started: it runs in a session of its own (its pid is the
    group's id), so the group is exactly its processes; killing only the shell would leave its children
    (a ``sleep``, a half-started server) running with nobody to reap them."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    proc.wait()


async def _status(session: aiohttp.ClientSession, url: str) -> tuple[int | None, str]:
    """(status, what it answered): (None, why) when nothing answered."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            await resp.read()
            return resp.status, f"{resp.status}"
    except aiohttp.ClientConnectorError as exc:
        refused = isinstance(exc.os_error, ConnectionRefusedError)
        return None, "connection refused" if refused else f"no connection ({exc.os_error})"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return None, f"no answer ({type(exc).__name__})"


async def wait_ready(base_url: str, timeout_s: float, *, arm: str, instance: int, fail_fast: bool = False,
                     note: Callable[[str], None] = lambda line: None) -> float:
    """Poll until the server at ``base_url`` (its root, no /v1) is ready; the seconds it took.

    When it is not ready at once, ``note`` gets one line saying what is awaited (so a wrong port is never
    a silent wait). ``fail_fast`` (no restart command: nothing is starting a server) makes a refused
    connection an error at once, since a server that is loading accepts connections (llama.cpp answers
    503). RestartError, naming the arm and instance, when it is not ready within ``timeout_s``."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    where = f"arm {arm}, instance {instance}"
    noted = False
    async with aiohttp.ClientSession(trust_env=False) as session:
        while True:
            health, said = await _status(session, f"{base_url}/health")
            if health == 200:
                return time.monotonic() - t0
            if health in (404, 405):  # no /health here: the model list is the next best sign
                models, said_models = await _status(session, f"{base_url}/v1/models")
                if models == 200:
                    return time.monotonic() - t0
                last = f"/health {health}, /v1/models {said_models}"
            else:
                last = f"/health {said}"
            if fail_fast and said == "connection refused":
                raise RestartError(f"nothing answers at {base_url} ({where}): connection refused; is --upstream "
                                   "right and the server running? (without --restart-cmd bench does not wait for "
                                   "one to start)")
            if time.monotonic() >= deadline:
                raise RestartError(f"the server at {base_url} ({where}) was not ready within {timeout_s:g} s "
                                   f"(last: {last})")
            if not noted:
                note(f"waiting for the server at {base_url} to be ready ({where}; last: {last}; at most "
                     f"{timeout_s:g} s)")
                noted = True
            await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class Look:
    """What the server said about itself at one moment: its metrics page (None when it has none) and
    its identity (start time, build, models)."""

    snapshot: Snapshot | None
    instance: Instance


async def look(session: aiohttp.ClientSession, base_url: str) -> Look | None:
    """The server's metrics and identity now; None when nothing answers."""
    snapshot = None
    try:
        async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            text = await resp.text(errors="replace")
            if resp.status == 200:
                snapshot = parse_exposition(text)
                header = float_or_none(resp.headers.get(START_HEADER))
                if header is not None:
                    snapshot = dataclasses.replace(snapshot, start_time_header=header)
    except (aiohttp.ClientConnectorError, ConnectionRefusedError):
        return None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        pass  # no metrics page: the identity's other parts may still tell
    instance = await identify_instance(session, base_url, snapshot=snapshot) if snapshot is not None else \
        await identify_instance(session, base_url)
    return Look(snapshot, instance)


def new_process(before: Look | None, after: Look) -> tuple[bool | None, str]:
    """Whether ``after`` is another server process than ``before``: (True, why), (False, why) or
    (None, why it cannot be told).

    A new process: nothing answered before, a different start time, kind, build or model list, or a
    counter that went down (a restart starts them from zero). The same process: the same start time
    from the same source, or counters that had counted something and carried on. A server that exposes
    neither a start time nor counters cannot be told apart from itself."""
    if before is None:
        return True, "nothing answered before the restart"
    if before.snapshot is not None and after.snapshot is not None:
        reason = restart_reason(before.snapshot, after.snapshot)
        if reason is not None:
            return True, reason
    reason = identity_changed(before.instance, after.instance)
    if reason is not None:
        return True, reason
    a, b = before.instance, after.instance
    if a.start_time is not None and b.start_time is not None and a.start_time_source == b.start_time_source:
        return False, f"its start time ({a.start_time_source}) did not change"
    if before.snapshot is not None and after.snapshot is not None and any(
            (getattr(before.snapshot, name) or 0) > 0 and getattr(after.snapshot, name) is not None
            for name in COUNTERS):
        return False, "its counters carried on from before the restart (a new process starts them from zero)"
    return None, "the server exposes neither a start time nor counters"
