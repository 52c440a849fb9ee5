"""The measuring worker's policy: gather turns into batches, build in the relay's gaps, never wait more than
MAX_DEFER_S per batch, stop waiting when turns queue faster than that, hand every turn back (measured or
with its error)."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time

import pytest

from specproxy.measure.build import build_record
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.serve.measuring import MAX_BATCH, MAX_DEFER_S, MeasuringWorker

SSE = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'


def _chat_turn(model: str, content: bytes | None = None) -> TurnRecorder:
    """A finished streamed chat turn whose request asks for ``model`` with no messages, or with one user
    message of ``content`` (a large one: a prompt measuring must parse)."""
    messages = b"[]" if content is None else b'[{"role":"user","content":"%s"}]' % content
    b = TurnRecorder(method="POST", path="/v1/chat/completions", t_wall=time.time(), t_request=1.0,
                      body=b'{"model":"%s","messages":%s}' % (model.encode(), messages))
    b.on_headers(1.1, 200, "text/event-stream")
    b.on_bytes(SSE, 1.2, 1.2)
    b.finish(1.3)
    return b


def _turn(n: int) -> TurnRecorder:
    return _chat_turn(f"m{n}")


def _stored(builder, record) -> bool:
    """The store, for tests of when and how turns are built: it takes every record."""
    return True


class _Held(MeasuringWorker):
    """A worker whose thread starts working only once every turn was submitted: "at once" for certain
    (a worker that wakes between two submits would make two batches of them, on a loaded machine)."""

    def __init__(self, *args, **kwargs) -> None:
        self.held = threading.Event()
        super().__init__(*args, **kwargs)

    def _run(self) -> None:
        self.held.wait(30)
        super()._run()


def _run(n: int, activity, *, broken: int | None = None, first=None) -> tuple[list, MeasuringWorker]:
    """Submit n turns at once; wait (bounded) until all came back on the loop. The turn numbered ``broken``
    fails to build; the first is built by ``first`` (a build function) when given. The worker's
    ``submitted`` lists the turns in order."""
    got: list = []
    done = asyncio.Event()
    submitted: list[TurnRecorder] = []

    def build(turn, tokenizer, prefixes):
        if broken is not None and turn is submitted[broken]:
            raise ValueError("nobody foresaw this")
        if first is not None and turn is submitted[0]:
            return first(turn, tokenizer, prefixes)
        return build_record(turn, tokenizer, prefixes)

    def on_done(results):
        got.extend(results)
        if len(got) == n:
            done.set()

    async def go():
        worker = _Held(None, activity, asyncio.get_running_loop(), on_done, store=_stored, build=build)
        worker.submitted = submitted
        submitted.extend(_turn(i) for i in range(n))
        for i, b in enumerate(submitted):
            worker.submit(b, more_in_flight=i < n - 1)
        worker.held.set()
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.to_thread(worker.stop)
        return worker

    worker = asyncio.run(go())
    return got, worker


def test_a_quiet_relay_is_measured_at_once():
    got, worker = _run(5, lambda: 0.0)  # the last read was long ago
    assert sorted(r.model for _, r, _, _ in got) == [f"m{i}" for i in range(5)]
    assert worker.deferred_s < MAX_DEFER_S


def test_a_busy_relay_defers_each_batch_at_most_max_defer():
    got, worker = _run(3, time.perf_counter)  # a read "just now", always: never a gap
    assert len(got) == 3 and all(exc is None for _, _, exc, _ in got)
    assert worker.deferred_s >= MAX_DEFER_S * 0.9 * worker.batches  # it did wait for a gap...
    assert worker.deferred_s <= (MAX_DEFER_S + 0.05) * worker.batches  # ...and no longer than allowed


def test_a_burst_that_begins_during_a_build_goes_before_the_next_build():
    busy_until = [0.0]
    took = [0.0]

    def waking(turn, tokenizer, prefixes):  # the relay starts a 5 ms burst as this turn's build ends
        t0 = time.perf_counter()
        built = build_record(turn, tokenizer, prefixes)  # however long a loaded CPU makes this, the burst follows it
        busy_until[0] = time.perf_counter() + 0.005
        took[0] = busy_until[0] - 0.005 - t0
        return built

    def activity() -> float:
        now = time.perf_counter()
        return now if now < busy_until[0] else 0.0

    got, worker = _run(2, activity, first=waking)
    assert len(got) == 2 and worker.batches == 1
    # it waited out the burst, within the batch's cap (which a build slowed by a loaded CPU eats into)
    waited_at_least = min(0.004, MAX_DEFER_S - took[0] - 0.001)
    assert waited_at_least <= worker.deferred_s <= MAX_DEFER_S + 0.05


def test_a_backlog_is_built_without_waiting():
    n = 20 * MAX_BATCH
    got, worker = _run(n, time.perf_counter)
    assert len(got) == n
    # waiting for a gap before every batch would take batches * MAX_DEFER_S; only the last few may wait
    assert worker.batches >= n // MAX_BATCH
    assert worker.deferred_s <= 4 * MAX_DEFER_S


def test_a_failing_build_comes_back_as_its_error():
    got, worker = _run(4, lambda: 0.0, broken=2)
    errors = [(b, exc) for b, rec, exc, _ in got if exc is not None]
    assert len(got) == 4 and len(errors) == 1
    builder, record, exc, _ = next(r for r in got if r[2] is not None)
    assert isinstance(exc, ValueError) and builder is worker.submitted[2]
    # the turn's row, made by the measuring thread, whose bytes it then let go of
    assert record.outcome == "proxy_error" and "measuring failed: ValueError" in record.error
    assert record.response_bytes == len(SSE) and record.request_bytes == len(b'{"model":"m2","messages":[]}')
    assert builder.body == b"" and builder.reads == []


def test_the_worker_hands_each_record_to_the_store_itself_before_the_loop_hears_of_it():
    """Records go from the measuring thread to the store's queue, in the order built, and the loop hears of
    the batch after that, with whether the store took each (its queue may be full: /metrics counts only
    what it took)."""
    stored: list = []  # (the thread that stored it, the turn's model)
    heard: list = []  # how many were stored when the loop heard of each batch, and the batch
    loop_thread: list = []

    def store(builder, record) -> bool:
        stored.append((threading.current_thread(), record.model))
        return record.model != "m1"  # the store's queue was full for this one

    async def go():
        loop_thread.append(threading.current_thread())
        done = asyncio.Event()

        def on_done(results):
            heard.append((len(stored), list(results)))
            if sum(len(r) for _, r in heard) == 3:
                done.set()

        worker = _Held(None, lambda: 0.0, asyncio.get_running_loop(), on_done, store=store)
        for i in range(3):
            worker.submit(_turn(i), more_in_flight=i < 2)
        worker.held.set()
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.to_thread(worker.stop)

    asyncio.run(go())
    assert [m for _, m in stored] == ["m0", "m1", "m2"]
    assert all(t.name == "specproxy-measure" and t is not loop_thread[0] for t, _ in stored)
    results = [b for _, batch in heard for b in batch]
    assert heard[0][0] >= len(heard[0][1])  # the batch was with the store before the loop heard of it
    assert [(b.record.model, b.stored) for b in results] == [("m0", True), ("m1", False), ("m2", True)]


@pytest.mark.parametrize("n", [1, MAX_BATCH + 3])
def test_stop_builds_what_is_queued(n):
    got: list = []

    async def go():
        worker = MeasuringWorker(None, time.perf_counter, asyncio.get_running_loop(), got.extend, store=_stored)
        for i in range(n):
            worker.submit(_turn(i), more_in_flight=True)
        # the worker schedules its results before it ends, so they run before this task resumes
        await asyncio.to_thread(worker.stop)

    asyncio.run(go())
    assert len(got) == n


@pytest.mark.parametrize(("delays", "median"), [([0.003, 0.001, 0.010], 0.003), ([0.003, 0.001, 0.002, 0.010], 0.0025)])
def test_proxy_delay_is_the_median_of_each_reads_write_minus_read(delays, median):
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=b"{}", t_wall=time.time(), t_request=1.0)
    b.on_headers(1.1, 200, "text/event-stream")
    for i, d in enumerate(delays):
        b.on_bytes(SSE if i == 0 else b"", 2.0 + i, 2.0 + i + d)
    b.finish(9.0)
    assert build_record(b, None).proxy_delay_s == pytest.approx(median)


def _json_turn(body: bytes, encoding: str = "", status: int = 200) -> TurnRecorder:
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=b'{"messages":[]}', t_wall=time.time(),
                      t_request=1.0)
    b.on_headers(1.1, status, "application/json", encoding)
    b.on_bytes(body, 1.2, 1.2)
    b.finish(1.3)
    return b


EMPTY_ANSWER = b'{"choices":[{"index":0,"message":{"role":"assistant","content":""}}]}'


@pytest.mark.parametrize(("body", "encoding", "why"), [
    (b"<html>not an answer</html>", "", "response body was not JSON"),
    (b'{"choices": [', "", "response body was not JSON"),
    (b"\x1f\x8b\x08\x00garbage, not gzip", "gzip", "response body did not decompress (gzip)"),
    (gzip.compress(EMPTY_ANSWER, mtime=0)[:-12], "gzip", "response body was not JSON"),  # cut short: inflates, then ends
], ids=["html", "cut-json", "not-gzip", "cut-gzip"])
def test_a_2xx_body_that_cannot_be_read_has_null_tokens_not_zero(tiktoken_tok, body, encoding, why):
    """Null, never 0: a successful status whose body could not be read says nothing about its tokens.
    The row says why, and still counts as forwarded (its outcome stays ok: the client got the bytes)."""
    rec = build_record(_json_turn(body, encoding), tiktoken_tok)
    assert rec.completion_tokens is None and rec.content_tokens is None
    assert rec.error == why and rec.outcome == "ok" and rec.response_bytes == len(body)


@pytest.mark.parametrize("encoding", ["", "gzip"])
def test_a_2xx_answer_read_with_no_text_has_zero_tokens(tiktoken_tok, encoding):
    """The other side of the rule: an answer that was read and holds no text is truly zero tokens."""
    body = gzip.compress(EMPTY_ANSWER) if encoding else EMPTY_ANSWER
    rec = build_record(_json_turn(body, encoding), tiktoken_tok)
    assert rec.completion_tokens == 0 and rec.error is None


def test_an_error_status_whose_body_is_not_json_keeps_its_own_error_line(tiktoken_tok):
    """A 502 HTML page is an upstream error; that its body is not JSON adds nothing to say."""
    rec = build_record(_json_turn(b"<html>bad gateway</html>", status=502), tiktoken_tok)
    assert rec.outcome == "upstream_error" and rec.completion_tokens is None and rec.error is None


def test_turns_that_end_while_a_batch_gathers_are_built_and_handed_back_together():
    """The first turn does not start a build at once: the turns that end within the gather window join
    it, and the loop gets them in one callback."""
    calls: list[int] = []
    got: list = []
    done = asyncio.Event()

    def on_done(results):
        calls.append(len(results))
        got.extend(results)
        if len(got) == 5:
            done.set()

    async def go():
        worker = MeasuringWorker(None, lambda: 0.0, asyncio.get_running_loop(), on_done, store=_stored,
                                 gather_s=2.0)
        for i in range(5):  # spread over ~40 ms, well inside the window; the last ends with none in flight
            worker.submit(_turn(i), more_in_flight=i < 4)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.to_thread(worker.stop)
        return worker

    worker = asyncio.run(go())
    assert calls == [5] and worker.batches == 1
    assert sorted(r.model for _, r, _, _ in got) == [f"m{i}" for i in range(5)]


def test_a_turn_that_ends_with_none_in_flight_is_built_without_gathering():
    """A lone chat's turn: nothing else is running, so nothing is coming to join its batch; it is built
    at once, not after the window (120 s here: the bounded wait below would fail first)."""
    got: list = []

    async def go():
        built = asyncio.Event()
        worker = MeasuringWorker(None, lambda: 0.0, asyncio.get_running_loop(),
                                 lambda results: (got.extend(results), built.set()), store=_stored,
                                 gather_s=120.0)
        worker.submit(_turn(0), more_in_flight=True)  # another turn still runs: this one waits for it
        worker.submit(_turn(1), more_in_flight=False)  # the last one ended: build both now
        await asyncio.wait_for(built.wait(), 30)
        await asyncio.to_thread(worker.stop)
        return worker

    worker = asyncio.run(go())
    assert [r.model for _, r, _, _ in got] == ["m0", "m1"] and worker.batches == 1


def _batch_sizes(first_taken_alone: bool) -> list[int]:
    """Submit ``MAX_BATCH`` turns with more in flight and a 120 s gathering window; the sizes of the batches
    built. ``first_taken_alone``: the worker takes the first turn off the queue before the rest come."""
    calls: list[int] = []

    async def go():
        built = asyncio.Event()
        worker = MeasuringWorker(None, lambda: 0.0, asyncio.get_running_loop(),
                                 lambda results: (calls.append(len(results)), built.set()), store=_stored,
                                 gather_s=120.0)
        worker.submit(_turn(0), more_in_flight=True)
        if first_taken_alone:
            for _ in range(10_000):  # until the worker has taken it (bounded: at most ~10 s)
                if worker._queue.qsize() == 0:
                    break
                await asyncio.sleep(0.001)
            assert worker._queue.qsize() == 0
        for i in range(1, MAX_BATCH):
            worker.submit(_turn(i), more_in_flight=True)
        await asyncio.wait_for(built.wait(), 30)
        await asyncio.to_thread(worker.stop)

    asyncio.run(go())
    return calls


def test_a_full_batch_ends_the_gathering():
    """Under traffic that keeps turns in flight, a batch is built once ``MAX_BATCH`` turns wait, not after
    the window (120 s here)."""
    assert _batch_sizes(first_taken_alone=False)[0] == MAX_BATCH


def test_a_full_batch_counts_the_turn_the_worker_already_took():
    """The batch's first turn, taken off the queue to gather behind, is one of the ``MAX_BATCH`` waiting:
    when the worker takes it before the others are submitted, the 32nd turn still ends the gathering (it
    once waited out the window: 31 queued never reached the count)."""
    assert _batch_sizes(first_taken_alone=True)[0] == MAX_BATCH


def test_stop_does_not_wait_out_a_gathering_batch():
    got: list = []

    async def go():
        worker = MeasuringWorker(None, lambda: 0.0, asyncio.get_running_loop(), got.extend, store=_stored,
                                 gather_s=120.0)
        worker.submit(_turn(0), more_in_flight=True)
        t0 = time.perf_counter()
        await asyncio.to_thread(worker.stop)
        return time.perf_counter() - t0

    took = asyncio.run(go())
    assert len(got) == 1 and got[0][1].model == "m0"
    assert took < 30  # the window is 120 s: stop cut it short



def test_turn_ids_are_unique_within_a_process_and_across_a_fork():
    import os
    import re

    from specproxy.record import new_turn_id

    ids = [new_turn_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    assert _turn(0).id != _turn(1).id
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, as its parent's next ones would be
        try:
            os.write(w, ",".join(new_turn_id() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read().split(",")
    os.waitpid(pid, 0)
    parent = [new_turn_id() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(parent) and not set(child) & set(ids)
    assert child[0][:16] != parent[0][:16]  # a fresh random part, not a copy of the parent's


def test_through_the_proxy_a_turn_waits_for_those_in_flight_and_the_last_ends_the_gathering(make_stack, monkeypatch):
    """The policy end to end, with ``Proxy`` saying what is in flight: a short turn that ends while a long
    one streams is not built alone; the long one, ending with none other in flight, ends the gathering
    (a 120 s window here: the bounded wait would fail first), and both are built in one batch."""
    import aiohttp

    from specproxy.serve import measuring
    from specproxy.app.fake_upstream import Script

    monkeypatch.setattr(measuring, "GATHER_S", 120.0)
    stack = make_stack()
    stack.upstream.script = lambda req: Script(
        pieces=["a", " b", " c"] * (20 if req.get("model") == "long" else 1), interval_s=0.02)

    async def turns():
        async with aiohttp.ClientSession() as c:
            async def one(model):
                async with c.post(stack.url + "/v1/chat/completions", json={
                        "model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
                    return await r.read()

            long = asyncio.ensure_future(one("long"))  # 60 chunks, 20 ms apart
            await one("short")  # 3 chunks: it ends while the long one streams
            await long

    stack.run(turns())
    deadline = time.monotonic() + 30
    while len(stack.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(r.model for r in stack.records) == ["long", "short"]
    assert stack.service.proxy._measurer.batches == 1


def test_the_servers_cached_prompt_tokens_from_usage_else_from_llama_cpps_timings():
    from specproxy.measure.completion import cached_tokens

    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 7}}, {"cache_n": 9}) == 7
    assert cached_tokens({}, {"cache_n": 9, "prompt_n": 3}) == 9  # llama.cpp's usage has no cached count
    assert cached_tokens({}, None) is None and cached_tokens({"prompt_tokens_details": None}, {}) is None


def test_cache_writes_are_read_apart_from_cache_reads():
    """Messages' ``cache_creation_input_tokens`` and Responses' ``cache_write_tokens`` are writes: kept in
    their own count, never added to the reads; absent, the count is None (not 0)."""
    from specproxy.measure import anthropic, responses
    from specproxy.measure.completion import cache_write_tokens, cached_tokens

    msg = anthropic.chat_usage({"input_tokens": 5, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 11,
                                "output_tokens": 2})
    assert msg["prompt_tokens"] == 23 and cached_tokens(msg, None) == 7 and cache_write_tokens(msg) == 11
    msg = anthropic.chat_usage({"input_tokens": 5, "cache_creation_input_tokens": 11})
    assert cached_tokens(msg, None) is None and cache_write_tokens(msg) == 11
    resp = responses.chat_usage({"input_tokens": 30, "input_tokens_details": {"cached_tokens": 8,
                                                                             "cache_write_tokens": 4}})
    assert cached_tokens(resp, None) == 8 and cache_write_tokens(resp) == 4
    assert cache_write_tokens(responses.chat_usage({"input_tokens": 3})) is None
    assert cache_write_tokens(anthropic.chat_usage({"input_tokens": 3, "cache_read_input_tokens": 1})) is None
    assert cache_write_tokens({"prompt_tokens_details": {"cached_tokens": 3}}) is None
    assert cache_write_tokens({"prompt_tokens_details": {"cache_write_tokens": True}}) is None



def test_small_turns_are_not_built_behind_a_backlog_of_large_ones():
    """Three large turns (a 1.5 MB prompt each) then three small ones, all queued before the worker starts:
    the small ones are handed back after at most one large one (FIFO built all three large first), and
    every large one is still built."""
    from specproxy.serve.measuring import LARGE_TURN_BYTES

    order: list[str] = []
    done = asyncio.Event()
    pad = b"x" * (LARGE_TURN_BYTES + LARGE_TURN_BYTES // 2)

    def on_done(results):
        order.extend(built.record.model for built in results)
        if len(order) == 6:
            done.set()

    async def go():
        worker = _Held(None, lambda: 0.0, asyncio.get_running_loop(), on_done, store=_stored)
        for i in range(3):
            worker.submit(_chat_turn(f"big{i}", pad), more_in_flight=True)
        for i in range(3):
            worker.submit(_turn(i), more_in_flight=i < 2)
        worker.held.set()
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.to_thread(worker.stop)

    asyncio.run(go())
    assert sorted(order) == ["big0", "big1", "big2", "m0", "m1", "m2"]
    assert max(order.index(f"m{i}") for i in range(3)) < order.index("big1"), order
    assert [m for m in order if m.startswith("big")] == ["big0", "big1", "big2"]  # large ones in their order


def test_a_batch_that_parsed_much_gives_the_heaps_pages_back(monkeypatch):
    """Parsing and counting a prompt makes objects several times its size, charged to nobody: a batch that
    parsed ``TRIM_BYTES`` of request bodies trims the heaps even when it gave nothing back to the budget
    (before, only charged bytes counted, and a backlog of uncharged prompts never trimmed)."""
    from specproxy.serve import measuring

    trims: list[int] = []
    monkeypatch.setattr(measuring, "TRIM_BYTES", 1 << 20)
    monkeypatch.setattr(measuring.memory, "trim", lambda: trims.append(1))
    got: list = []
    done = asyncio.Event()

    def on_done(results):
        got.extend(results)
        done.set()

    async def go():
        worker = _Held(None, lambda: 0.0, asyncio.get_running_loop(), on_done, store=_stored)
        b = _chat_turn("m", b"x" * (1 << 20))
        assert b.charged() == 0  # nothing charged (no budget): only the parsing counts
        worker.submit(b, more_in_flight=False)
        worker.held.set()
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.to_thread(worker.stop)

    asyncio.run(go())
    assert got[0][1].model == "m" and trims == [1]
