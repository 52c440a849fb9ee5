"""Slow request bodies: a whole-body deadline (``body_timeout_s``), and a request that counts toward
``max_concurrent`` only once its body is whole, so that clients trickling bodies lock nobody out.

Raw-socket clients against both fronts (the lane reads bodies with a Content-Length; chunked ones go to
aiohttp's server).
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from faultkit import await_until, kernel_queued, post_head, request_once

pytestmark = pytest.mark.usefixtures("each_front")

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def _trickle_body(port: int, head: bytes, pieces: list[bytes], every: float, stop: asyncio.Event,
                        started: asyncio.Event | None = None) -> bytes:
    """Send ``head``, then one of ``pieces`` every ``every`` s (the pace of a slow client) until the server
    answers or ``stop`` is set; return what the server sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        writer.write(head)
        for i, piece in enumerate(pieces):
            writer.write(piece)
            await writer.drain()
            if i == 0 and started is not None:
                started.set()
            try:
                got = await asyncio.wait_for(reader.read(65536), every)
            except (asyncio.TimeoutError, TimeoutError):
                if stop.is_set():
                    return got
                continue
            return got
        return got
    except ConnectionError:
        return got
    finally:
        writer.close()


def _chunked_head(path: str = CHAT) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()


def test_slow_request_bodies_do_not_lock_other_clients_out(make_stack):
    """Twelve clients trickle request bodies (chunked ones, which the lane hands to aiohttp, and ones with
    a Content-Length, which the lane reads) past ``max_concurrent`` = 4: none of them counts until its body
    is whole, so honest clients meanwhile are all served."""
    stack = make_stack(max_concurrent=4, header_timeout_s=5, body_timeout_s=60, scrape_interval_s=0)
    port = stack.service.port

    async def go():
        stop = asyncio.Event()
        started = [asyncio.Event() for _ in range(12)]
        slow = []
        for i in range(12):
            if i % 2:
                head, pieces = _chunked_head(), [b"1\r\n{\r\n"] + [b"1\r\n \r\n"] * 200
            else:
                head, pieces = post_head(CHAT, b" " * 200)[:-200], [b" "] * 200
            slow.append(asyncio.ensure_future(_trickle_body(port, head, pieces, 0.2, stop, started[i])))
        for ev in started:
            await asyncio.wait_for(ev.wait(), 10)
        # every slow head and first piece has been read by the proxy before the honest clients come
        await await_until(lambda: kernel_queued({port}) == 0, 5, what="the proxy to read the slow heads")
        honest = [await request_once(port, post_head(CHAT, BODY)) for _ in range(6)]
        stop.set()
        await asyncio.gather(*slow)
        return honest

    honest = stack.run(go())
    assert [r.status for r in honest] == [200] * 6
    assert stack.service.counters.rejected_busy == 0


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_trickled_under_the_stall_timeout_still_gets_408_at_the_body_deadline(make_stack, framing):
    stack = make_stack(header_timeout_s=0.6, body_timeout_s=1.0, scrape_interval_s=0)
    port = stack.service.port
    if framing == "chunked":
        head, pieces = _chunked_head(), [b"1\r\n \r\n"] * 100
    else:
        head, pieces = post_head(CHAT, b" " * 100)[:-100], [b" "] * 100

    async def go():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await _trickle_body(port, head, pieces, 0.15, asyncio.Event())
        return got, loop.time() - t0

    got, took = stack.run(go())
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    assert b"not complete within 1 s" in got
    # not before the 1 s deadline; well before the 15 s the trickle would take without one (a loaded machine
    # can delay the answer by seconds, never by ten)
    assert 0.9 < took < 10.0, took
    assert len(stack.upstream.sent) == 0  # nothing of it reached the upstream


def test_bodies_past_the_memory_budget_are_refused_before_they_are_read(make_stack):
    """A 64 MiB budget (large bodies may fill 48 MiB of it): one client holds a 32 MiB body half sent; a
    second 32 MiB body gets 503 at its head, a chunked one once its reads pass the share; a small request
    is served meanwhile; once the first client hangs up, everything it was charged is given back."""
    from specproxy.wire import memory

    stack = make_stack(memory_budget_bytes=64 << 20, scrape_interval_s=0)
    port = stack.service.port
    proxy = stack.service.proxy
    big = 32 << 20

    async def settled() -> int:
        """The process-wide count once the earlier tests' proxies (this worker's) have given their charges
        back: unchanged over half a second, within a bounded wait."""
        last, since = memory.used(), asyncio.get_running_loop().time()
        for _ in range(600):
            await asyncio.sleep(0.05)
            now = memory.used()
            if now != last:
                last, since = now, asyncio.get_running_loop().time()
            elif asyncio.get_running_loop().time() - since >= 0.5:
                return now
        raise AssertionError(f"the memory count never settled: {last}")

    async def go():
        before = await settled()
        holder_r, holder_w = await asyncio.open_connection("127.0.0.1", port)
        holder_w.write(post_head(CHAT, b" " * big)[: -big // 2])  # its head and half its body
        await holder_w.drain()
        await await_until(lambda: memory.used() >= before + big, 30, what="the held body charged")
        refused = await request_once(port, post_head(CHAT, b" " * big))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_chunked_head())
        got = b""
        try:
            for _ in range(30):  # 30 MiB at most: refused past 16 MiB
                writer.write(b"100000\r\n" + b" " * (1 << 20) + b"\r\n")
                await writer.drain()
                try:
                    got = await asyncio.wait_for(reader.read(65536), 0.05)
                except (asyncio.TimeoutError, TimeoutError):
                    continue
                break
        except ConnectionError:
            pass
        if not got:
            got = await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
        small = await request_once(port, post_head(CHAT, BODY))
        holder_w.close()
        await await_until(lambda: memory.used() <= before, 30, what="the budget given back")
        return refused, got, small

    refused, chunked, small = stack.run(go())
    assert refused is not None and refused.status == 503 and b"memory_budget" in refused.body
    assert chunked.startswith(b"HTTP/1.1 503 ") and b"memory_budget" in chunked
    assert small is not None and small.status == 200
    assert proxy.counters.rejected_memory == 2
