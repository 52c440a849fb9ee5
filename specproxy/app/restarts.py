"""Restarting the inference server between a benchmark's blocks, and knowing when it is ready again.

Why: the same configuration varies 15-19% from one server start to the next, so an A/B that ran each
arm in one process cannot tell the setting from the restart (docs/statistics.md). Running each arm in
several processes, interleaved (A B B A ...), gives ``compare`` an interval over instances. specproxy
does not know how your server is started, so the user's command does it: it must stop the running
server and start the arm's (in the background) and return; its exit status is checked. Then the
server's readiness is polled: llama.cpp answers ``/health`` 503 while the model loads, vLLM and
SGLang answer ``/health`` 200 once ready; a server without ``/health`` is ready when ``/v1/models``
answers 200.

The command's output goes to a file, never a pipe: a server started in the background inherits the
command's stdout, and a pipe would then stay open (and the wait never end) for the server's life.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import tempfile
import time

import aiohttp

from specproxy.config import child_environment
from specproxy.errors import SpecproxyError

__all__ = ["RestartError", "restart_command", "run_restart", "wait_ready"]

POLL_S = 0.2  # between readiness polls: a server's start is not an event we can wait on


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
            proc.kill()
            proc.wait()
            raise RestartError(f"restart command for arm {arm} (instance {instance}) did not return within "
                               f"{timeout_s:g} s (it must start the server in the background and exit)") from None
        if status != 0:
            out.seek(0)
            tail = [line for line in out.read().decode("utf-8", "replace").splitlines() if line.strip()][-1:]
            said = f": {tail[0].strip()[:200]}" if tail else ""
            raise RestartError(f"restart command for arm {arm} (instance {instance}) exited with status {status}{said}")


async def _status(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def wait_ready(base_url: str, timeout_s: float) -> float:
    """Poll until the server at ``base_url`` (its root, no /v1) is ready; the seconds it took. RestartError
    when it is not within ``timeout_s``, saying what it last answered."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(trust_env=False) as session:
        while True:
            health = await _status(session, f"{base_url}/health")
            if health == 200:
                return time.monotonic() - t0
            if health in (404, 405):  # no /health here: the model list is the next best sign
                models = await _status(session, f"{base_url}/v1/models")
                if models == 200:
                    return time.monotonic() - t0
                last = f"/health {health}, /v1/models {models or 'no answer'}"
            else:
                last = f"/health {health}" if health is not None else "no answer (connection refused or timed out)"
            if time.monotonic() >= deadline:
                raise RestartError(f"the server at {base_url} was not ready within {timeout_s:g} s (last: {last})")
            await asyncio.sleep(POLL_S)
