"""The scraper (``specproxy.observe.scrape``) and instance identity (``specproxy.observe.instance``) against a
tiny aiohttp server on 127.0.0.1: polling, failures, turning itself off, re-identifying on a restart,
large pages parsed off the loop, no blocking call on the loop. Waits are on events with deadlines.
Parsing and the counter arithmetic are tested in tests/unit/test_server_metrics.py and test_counters.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from specproxy.observe import scrape as scrape_mod
from pages import (LLAMACPP_OLD_PAGE, VLLM_PAGE, llamacpp_page, sglang_page)
from specproxy.observe.scrape import (
    PARSE_INLINE_MAX_BYTES,
    Instance,
    ScrapeSample,
    Scraper,
    identify_instance,
    window_counters,
)

DEADLINE_S = 5.0


# ----------------------------------------------------------------------------------------------
# A tiny upstream on 127.0.0.1
# ----------------------------------------------------------------------------------------------


class FakeServer:
    """Serves whatever the test sets: a /metrics page (or a status), models, props, version."""

    def __init__(self) -> None:
        self.metrics_text = llamacpp_page()
        self.metrics_status: list[int] = []  # statuses to serve before the page, one per request
        self.metrics_headers: dict[str, str] = {}
        self.models: list[str] | None = ["qwen3-8b"]
        self.props: dict[str, object] | None = None
        self.version: dict[str, object] | None = None
        self.server_info: dict[str, object] | None = None
        self.metrics_requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/props", self._props)
        app.router.add_get("/version", self._version)
        app.router.add_get("/get_server_info", self._server_info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics_requests += 1
        if self.metrics_status:
            status = self.metrics_status.pop(0)
            return web.Response(status=status, text=f"status {status}\n")
        return web.Response(text=self.metrics_text, headers=self.metrics_headers, content_type="text/plain")

    async def _models(self, _request: web.Request) -> web.Response:
        if self.models is None:
            return web.Response(status=500, text="boom")
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _props(self, _request: web.Request) -> web.Response:
        return self._json(self.props)

    async def _version(self, _request: web.Request) -> web.Response:
        return self._json(self.version)

    async def _server_info(self, _request: web.Request) -> web.Response:
        return self._json(self.server_info)

    @staticmethod
    def _json(data: dict[str, object] | None) -> web.Response:
        return web.json_response(data) if data is not None else web.Response(status=404)


class Collector:
    """An ``on_sample`` that never blocks, and lets a test wait for a condition with a deadline."""

    def __init__(self) -> None:
        self.samples: list[ScrapeSample] = []
        self._waiters: list[tuple[Callable[[list[ScrapeSample]], bool], asyncio.Event]] = []

    def __call__(self, s: ScrapeSample) -> None:
        self.samples.append(s)
        for pred, event in self._waiters:
            if pred(self.samples):
                event.set()

    async def until(self, pred: Callable[[list[ScrapeSample]], bool]) -> None:
        if pred(self.samples):
            return
        event = asyncio.Event()
        self._waiters.append((pred, event))
        await asyncio.wait_for(event.wait(), DEADLINE_S)


def run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 4 * DEADLINE_S))  # type: ignore[arg-type]


def test_scraper_counts_samples_and_changing_counters() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 3)
            srv.metrics_text = llamacpp_page(predicted=1200, drafts=350, draft_tokens=1050, accepted=700)
            await got.until(lambda s: s[-1].snapshot.generation_tokens_total == 1200.0)
            await scraper.stop()
            assert not scraper.running
            assert scraper.samples == len(got.samples) >= 4
            assert scraper.failures == 0 and scraper.last_error is None
            ids = {s.instance_id for s in got.samples}
            assert scraper.instance_id is not None and scraper.instance_id.startswith("inst-")
            assert ids == {scraper.instance_id}
            assert [s.t_mono for s in got.samples] == sorted(s.t_mono for s in got.samples)
            assert all(s.latency_s is not None and s.latency_s >= 0 for s in got.samples)
            w = window_counters(got.samples, got.samples[0].t_mono, got.samples[-1].t_mono)
            assert w is not None and w.generated_tokens == 200.0 and w.mal == pytest.approx(1 + 100 / 50)

    run(main)


def test_scraper_counts_500_as_failure_without_raising() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [500, 500]
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 1)
            await scraper.stop()
            assert scraper.failures == 2
            assert scraper.last_error == "ScrapeError: HTTP 500"
            assert scraper.disabled_reason is None

    run(main)


def test_scrape_once_survives_malformed_page_and_refused_connection() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = "<html>oops</html>\n"
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and "not a Prometheus text exposition" in (scraper.last_error or "")
            closed_url = srv.url
        async with aiohttp.ClientSession() as session:  # server gone: connection refused
            scraper = Scraper(session, closed_url, interval_s=1.0, timeout_s=1.0)
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and scraper.last_error

    run(main)


@pytest.mark.parametrize("status", [404, 501])
def test_scraper_turns_itself_off_when_there_is_no_metrics_endpoint(status: int) -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [status] * 100
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=Collector())
            scraper.start()
            await asyncio.wait_for(scraper.wait(), DEADLINE_S)
            assert not scraper.running
            assert scraper.disabled_reason and str(status) in scraper.disabled_reason
            assert srv.metrics_requests == 1 and scraper.samples == 0
            scraper.start()  # stays off
            assert not scraper.running

    run(main)


def test_404_after_a_success_is_a_failure_not_a_shutdown() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is not None
            srv.metrics_status = [404]
            assert await scraper.scrape_once() is None
            assert scraper.failures == 1 and scraper.disabled_reason is None

    run(main)


def test_scraper_reidentifies_on_restart_with_new_start_time() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            srv.version = {"version": "0.11.0"}
            srv.models = ["Qwen/Qwen3-32B"]
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            first = scraper.instance
            assert first is not None and first.build == "0.11.0" and first.start_time == 1.76e9
            srv.metrics_text = VLLM_PAGE.replace("seconds 1.76e+09", "seconds 1.77e+09")  # process start
            await got.until(lambda s: any(x.restart for x in s))
            await scraper.stop()
            restart_at = next(i for i, s in enumerate(got.samples) if s.restart)
            assert got.samples[restart_at].instance_id != first.instance_id
            assert {s.instance_id for s in got.samples[restart_at:]} == {scraper.instance_id}
            assert scraper.restarts == 1 and scraper.instance is not None
            assert scraper.instance.start_time == 1.77e9 and scraper.instance.restart_epoch is None

    run(main)


def test_restart_without_start_time_gets_a_new_id_each_time() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            ids = [scraper.instance_id]
            for n in (1, 2):
                srv.metrics_text = llamacpp_page(predicted=1, drafts=0, draft_tokens=0, accepted=0)

                def restarted_n(s: list[ScrapeSample], n: int = n) -> bool:
                    return sum(x.restart for x in s) >= n

                await got.until(restarted_n)
                ids.append(scraper.instance_id)
                srv.metrics_text = llamacpp_page(predicted=5000, drafts=0, draft_tokens=0, accepted=0)
                await got.until(lambda s: s[-1].snapshot.generation_tokens_total == 5000.0)
            await scraper.stop()
            assert len(set(ids)) == 3, ids
            assert scraper.instance is not None and scraper.instance.restart_epoch is not None

    run(main)


def test_model_change_found_by_periodic_identity_check() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got, identify_every_s=0.0)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            first = scraper.instance_id
            srv.models = ["qwen3-32b"]
            await got.until(lambda s: any(x.restart for x in s))
            await scraper.stop()
            assert scraper.instance_id != first
            assert scraper.instance is not None and scraper.instance.models == ("qwen3-32b",)

    run(main)


def test_failed_identity_lookup_does_not_fake_a_restart() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got, identify_every_s=0.0)
            scraper.start()
            await got.until(lambda s: len(s) >= 2)
            srv.models = None  # /v1/models now answers 500
            n = len(got.samples)
            await got.until(lambda s: len(s) >= n + 3)
            await scraper.stop()
            assert not any(s.restart for s in got.samples) and scraper.restarts == 0

    run(main)


def test_callback_exception_does_not_stop_the_poller() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()

            def flaky(s: ScrapeSample) -> None:
                got(s)
                if len(got.samples) == 1:
                    raise RuntimeError("consumer bug")

            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=flaky)
            scraper.start()
            await got.until(lambda s: len(s) >= 3)
            await scraper.stop()
            assert scraper.callback_failures == 1 and scraper.failures == 0

    run(main)


def test_stop_is_prompt_even_with_a_long_interval() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=3600.0, on_sample=got)
            scraper.start()
            await got.until(lambda s: len(s) >= 1)
            await asyncio.wait_for(scraper.stop(), 2.0)
            assert not scraper.running and srv.metrics_requests == 1

    run(main)


def test_large_pages_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = asyncio.to_thread

    async def spy(fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)  # the module object scrape.py calls through

    # A page above the inline limit (llama.cpp's own is ~2.5 KB, a vLLM page ~40 KB).
    big = llamacpp_page() + "".join(
        f'tgi_padding{{i="{i}"}} {i}\n' for i in range(PARSE_INLINE_MAX_BYTES // 20)
    )

    async def main_big() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = big
            scraper = Scraper(session, srv.url, interval_s=1.0)
            s = await scraper.scrape_once()
            assert s is not None and s.snapshot.generation_tokens_total == 1000.0

    async def main_small() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = LLAMACPP_OLD_PAGE.format(predicted=1)
            scraper = Scraper(session, srv.url, interval_s=1.0)
            assert await scraper.scrape_once() is not None

    run(main_small)
    assert scrape_mod.parse_exposition not in calls
    run(main_big)
    assert scrape_mod.parse_exposition in calls


def test_scraper_makes_no_blocking_call_on_the_event_loop() -> None:
    from blockbuster import blockbuster_ctx

    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            got = Collector()
            scraper = Scraper(session, srv.url, interval_s=0.01, on_sample=got)
            with blockbuster_ctx():
                scraper.start()
                await got.until(lambda s: len(s) >= 3)
                await scraper.stop()
            # blockbuster raises inside the loop; the scraper would count it, so both must be 0
            assert scraper.failures == 0 and scraper.callback_failures == 0
            assert len(srv.metrics_text) > PARSE_INLINE_MAX_BYTES  # the threaded parse ran too

    run(main)


# ----------------------------------------------------------------------------------------------
# Instance identity
# ----------------------------------------------------------------------------------------------


def test_identify_llamacpp_from_props_models_and_start_header() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_headers = {"Process-Start-Time-Unix": "1760000000"}
            srv.props = {"build_info": "b6100-deadbee", "model_path": "/models/qwen3-8b-q4_k_m.gguf", "total_slots": 4}
            inst = await identify_instance(session, srv.url)
            assert inst.server_kind == "llamacpp"
            assert inst.start_time == 1.76e9 and inst.start_time_source == "Process-Start-Time-Unix"
            assert inst.models == ("qwen3-8b",) and inst.build == "b6100-deadbee"
            assert inst.model_path == "/models/qwen3-8b-q4_k_m.gguf" and inst.total_slots == 4
            assert inst.errors == ()
            again = await identify_instance(session, srv.url + "/")
            assert again.instance_id == inst.instance_id  # stable, URL normalized
            srv.props = {**srv.props, "build_info": "b6200-cafe"}
            assert (await identify_instance(session, srv.url)).instance_id != inst.instance_id

    run(main)


def test_identify_vllm_and_sglang_builds() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_text = VLLM_PAGE
            srv.models = ["Qwen/Qwen3-32B"]
            srv.version = {"version": "0.11.0"}
            inst = await identify_instance(session, srv.url)
            assert (inst.server_kind, inst.build) == ("vllm", "0.11.0")
            assert inst.start_time_source == "process_start_time_seconds"
            srv.metrics_text = sglang_page()
            srv.server_info = {"version": "0.5.3", "model_path": "deepseek-ai/DeepSeek-V3"}
            inst = await identify_instance(session, srv.url)
            assert (inst.server_kind, inst.build, inst.model_path) == ("sglang", "0.5.3", "deepseek-ai/DeepSeek-V3")
            assert inst.start_time is None

    run(main)


def test_identify_tolerates_every_failure() -> None:
    async def main() -> None:
        async with FakeServer() as srv, aiohttp.ClientSession() as session:
            srv.metrics_status = [500]
            srv.models = None
            inst = await identify_instance(session, srv.url)
            assert isinstance(inst, Instance) and inst.server_kind == "unknown"
            assert inst.models is None and inst.build is None
            assert any(e.startswith("/metrics") for e in inst.errors)
            assert any(e.startswith("/v1/models") for e in inst.errors)
            url = srv.url
        async with aiohttp.ClientSession() as session:
            inst = await identify_instance(session, url, timeout_s=1.0)  # nobody listening
            assert inst.instance_id.startswith("inst-") and len(inst.errors) >= 2

    run(main)
