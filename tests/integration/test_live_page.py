"""The live page in a real browser (Debian's chromium driven by Playwright), and the HTML report opened
from a file with the network off: the charts draw one bar per turn, the figures printed are the ones
``report --json`` gives, and a new turn appears without a reload.

chromium is a system package (``apt-get install chromium``; .ci/run installs it): without it these tests
skip, unless ``SPECPROXY_REQUIRE_BROWSER=1`` (CI sets it), which makes the skip a failure.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import orjson
import pytest

from specproxy.app.fake_upstream import Script, pieces_of
from specproxy.view.live import LivePages
from waits import wait_for

REQUIRE_ENV = "SPECPROXY_REQUIRE_BROWSER"
ARTIFACTS = Path(os.environ.get("SPECPROXY_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
SPECPROXY = str(Path(sys.executable).parent / "specproxy")


@pytest.fixture
def chromium():
    """Starts the browser when called: after the proxy's stack exists, because Playwright's synchronous API
    runs an event loop in this thread, and the stack's blockbuster check (conftest.py) then takes the
    stack's own start-up, here, for blocking calls on a loop."""
    exe = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if exe is None or sync_playwright is None:
        why = "chromium is not installed (apt-get install chromium)" if exe is None else "playwright is not installed"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{why} ({REQUIRE_ENV}=1 forbids skipping)", pytrace=False)
        pytest.skip(why)
    started = []

    def launch():
        p = sync_playwright().start()
        started.append(p)
        return p.chromium.launch(executable_path=exe, headless=True)

    yield launch
    for p in started:
        p.stop()


def _chat(stack, tok, n: int, first: int = 0) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0, timeout=30)
    for i in range(first, first + n):
        stack.upstream.script = Script(pieces=pieces_of("word " * (5 + 3 * i), tok), interval_s=0.002)
        stream = client.chat.completions.create(model="m", stream=True, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {i}."}])
        for _ in stream:
            pass


def _committed(stack, n: int) -> None:
    stack.settle()
    assert wait_for(lambda: stack.service.writer.written >= n), "the writer did not commit the turns"


def _report_json(db: str) -> dict:
    out = subprocess.run([SPECPROXY, "report", "--db", db, "--json", "--no-cache"], capture_output=True, text=True,
                         timeout=60, check=True)
    return orjson.loads(out.stdout)


def _lookup(report: dict, path: str):
    v = report
    for part in path.split("/"):
        v = v[part]
    return v


def _check_figures(page, report: dict, skip: str = "") -> int:
    """Every figure the page prints against ``report --json``; how many were compared."""
    cells = page.eval_on_selector_all("[data-figure]", "els => els.map(e => [e.dataset.figure, e.dataset.value])")
    compared = 0
    for path, shown in cells:
        if skip and path.startswith(skip):
            continue
        want = _lookup(report, path)
        if want is None or (isinstance(want, float) and not math.isfinite(want)):
            assert shown == "", path
        else:
            assert math.isclose(float(shown), float(want), rel_tol=1e-12, abs_tol=1e-12), (path, shown, want)
        compared += 1
    return compared


def test_the_live_page_draws_the_turns_and_updates_live(make_stack, tiktoken_tok, chromium):
    stack = make_stack(tiktoken_tok)
    stack.service.admin.pages = LivePages(stack.cfg.db)  # what `specproxy serve` composes in
    _chat(stack, tiktoken_tok, 3)
    _committed(stack, 3)
    browser = chromium()
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.goto(stack.url + "/_specproxy/")
    page.wait_for_selector("body:not([data-updates='0'])")  # the event stream delivered its first picture
    assert page.locator(".turns .turn").count() == 3
    assert page.locator(".dist rect").count() > 0 and page.locator(".speedup polyline").count() >= 1
    # the figures on the page are report --json's (the server's counters move with each scrape: not compared)
    assert _check_figures(page, _report_json(stack.cfg.db), skip="server/") >= 25
    page.evaluate("window.notReloaded = true")
    _chat(stack, tiktoken_tok, 1, first=3)
    _committed(stack, 4)
    page.wait_for_function("document.querySelectorAll('.turns .turn').length === 4", timeout=20_000)
    assert page.evaluate("window.notReloaded") is True  # the same page, updated by its event stream
    assert _check_figures(page, _report_json(stack.cfg.db), skip="server/") >= 25
    last = page.locator(".turns .turn").last
    turn_id = last.get_attribute("data-turn-id")
    last.click()
    assert page.locator("#record").get_attribute("data-turn-id") == turn_id
    assert turn_id in page.locator("#record").inner_text()
    assert "Count to" not in page.content() and "sk-test" not in page.content()  # no text, no keys
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "live-page.png"), full_page=True)
    page.close()


def test_the_html_report_opens_offline_with_the_same_figures(make_stack, tiktoken_tok, chromium, tmp_path):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.2)
    _chat(stack, tiktoken_tok, 5)
    _committed(stack, 5)
    assert wait_for(lambda: len(stack.service.watch.recent) >= 3)  # the server's counters, scraped
    stack.run(stack.service.watch.stop())
    stack.service.writer.close()  # every turn and scrape is in the file: both reports read the same rows
    db = stack.cfg.db
    html = tmp_path / "report.html"
    subprocess.run([SPECPROXY, "report", "--db", db, "--html", str(html), "--no-cache"], capture_output=True,
                   timeout=60, check=True)
    report = _report_json(db)
    context = chromium().new_context(offline=True)
    fetched: list[str] = []
    context.on("request", lambda r: fetched.append(r.url))
    page = context.new_page()
    page.goto(html.as_uri())
    assert fetched == [html.as_uri()]  # nothing but the file itself
    assert page.locator(".turns .turn").count() == 5
    assert _check_figures(page, report) >= 25
    assert page.locator(".server rect").count() == 3  # generated, accepted, delivered tokens/s
    page.locator(".turns .turn").first.click()
    assert page.locator("#record").get_attribute("data-turn-id") == page.locator(".turns .turn").first.get_attribute(
        "data-turn-id")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "html-report.png"), full_page=True)
    context.close()
