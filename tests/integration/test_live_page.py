"""The live page in a real browser (Debian's chromium driven by Playwright), and the HTML report opened
from a file with the network off: the charts draw one bar per turn, the figures printed are the ones
``report --json`` gives, and a new turn appears without a reload.

chromium is a system package (``apt-get install chromium``; .ci/run installs it): without it these tests
skip, unless ``SPECPROXY_REQUIRE_BROWSER=1`` (CI sets it), which makes the skip a failure.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import openai
import orjson
import pytest

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.app.demo import ANSWERS, QUESTIONS, SYSTEM_PROMPT
from specproxy.app.fake_upstream import Script, pieces_of
from specproxy.store.db import connect
from specproxy.view.html import document
from specproxy.view.live import LivePages
from specproxy.view.snapshot import snapshot
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


TOKEN = "t0ken-for-the-live-page-test"
LEVELS = (1, 3)  # turns run alone, then this many at once: two levels of the operating point
SLOTS = 24  # the timeline's slots (analyze/pictures.py)
PART_FIELDS = ("prompt_system_tokens", "prompt_tools_tokens", "prompt_history_tokens", "prompt_new_tokens")
TOOLS = [{"type": "function", "function": {
    "name": f"workspace_tool_{i}", "description": "Reads, searches or edits a file in the user's workspace.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for i in range(3)]


def _speculative(tok):
    """Like the demo's upstream: several tokens per chunk (how many varies from turn to turn), drafts
    accepted in llama.cpp's counters, and a TTFT long enough that turns started together overlap."""
    answers = [pieces_of(a, tok) for a in ANSWERS]
    cycles = ((1, 3, 2, 4, 2, 1, 3), (2, 4, 4, 3), (1, 1, 2), (3, 4, 2, 4, 4))
    turn = itertools.count()

    def script(_request: dict) -> Script:
        i = next(turn)
        return Script(pieces=answers[i % len(answers)], ttft_s=0.15, interval_s=0.003,
                      tokens_per_chunk=cycles[i % len(cycles)], drafts_per_chunk=4, usage="last")

    return script


def _conversation(stack, turns: int, label: str | None = None, start: threading.Barrier | None = None) -> None:
    """A chat client as the demo's: a system prompt and tools on every turn and a growing history, so each
    of the prompt's four parts is there."""
    headers = {"X-Specproxy-Label": label} if label else None
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0, timeout=30,
                           default_headers=headers)
    history = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! What can I do?"}]
    if start is not None:
        start.wait(timeout=30)
    for i in range(turns):
        question = {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}
        stream = client.chat.completions.create(model="m", stream=True, tools=TOOLS, messages=[
            {"role": "system", "content": SYSTEM_PROMPT}, *history, question])
        for _ in stream:
            pass
        history += [question, {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]}]


def _traffic(stack, label: str | None = None) -> int:
    """Turns at each of LEVELS (two turns per client); how many."""
    for level in LEVELS:
        barrier = threading.Barrier(level)
        threads = [threading.Thread(target=_conversation, args=(stack, 2, label, barrier)) for _ in range(level)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return 2 * sum(LEVELS)


def _committed(stack, n: int) -> None:
    stack.settle()
    assert wait_for(lambda: stack.service.writer.written >= n), "the writer did not commit the turns"


def _report_json(db: str, *window: str) -> dict:
    out = subprocess.run([SPECPROXY, "report", "--db", db, "--json", "--no-cache", *window], capture_output=True,
                         text=True, timeout=60, check=True)
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


def _rows(db: str, since: float | None = None, label: str | None = None) -> list[dict]:
    """The measured turns of a window, read from the database by the test itself."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            "SELECT * FROM turns WHERE measured IS NOT 0 AND t_wall >= ? AND (? IS NULL OR label IS ?) "
            "ORDER BY t_wall, rowid", (since if since is not None else -1.0, label, label))]
    finally:
        conn.close()


def _busy(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def _close(a: float, b: float, tol: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _inside(page, selector: str) -> None:
    """Each element's box lies inside its chart, and no two of them overlap (labels readable)."""
    boxes = page.eval_on_selector_all(selector, """els => els.map(e => {
        const b = e.getBoundingClientRect(), s = e.closest('svg').getBoundingClientRect();
        return [b.left, b.top, b.right, b.bottom, s.left, s.top, s.right, s.bottom, e.closest('svg').className.baseVal];
    })""")
    assert boxes, selector
    for l, t, r, b, sl, st, sr, sb, _ in boxes:
        assert sl <= l and r <= sr + 0.5 and st <= t and b <= sb + 0.5, (selector, (l, t, r, b), (sl, st, sr, sb))
    for i, one in enumerate(boxes):
        for other in boxes[i + 1:]:
            if one[8] == other[8] and one[4:8] == other[4:8]:  # the same chart
                apart = one[2] <= other[0] or other[2] <= one[0] or one[3] <= other[1] or other[3] <= one[1]
                assert apart, (selector, one, other)


def _check_charts(page, rows: list[dict], report: dict) -> None:
    """Each chart against the turns the test read itself and against ``report --json``: the bars' widths,
    the histograms' bins, the operating point's levels, the throughput timeline, the speedup curve and its
    ceiling (numbers the page carries on each mark as data-*, tied to what is drawn)."""
    ok = [r for r in rows if r["outcome"] == "ok"]
    streamed = [r for r in ok if r["streamed"] == 1]
    by_id = {r["id"]: r for r in rows}
    # recent turns: TTFT and decode drawn in proportion to the record; the prompt's four parts beside
    per_s, per_tok = (float(page.get_attribute(".turns", a)) for a in ("data-px-per-s", "data-px-per-token"))
    bars = page.eval_on_selector_all(".turns .turn", """gs => gs.map(g => [g.dataset.turnId,
        [...g.querySelectorAll('rect[class]')].map(r => [r.getAttribute('class'), +r.getAttribute('width')])])""")
    assert [i for i, _ in bars] == [r["id"] for r in rows][-len(bars):]  # the newest, oldest first
    longest = max(by_id[i]["total_s"] for i, _ in bars)
    largest = max(by_id[i]["prompt_tokens"] for i, _ in bars)
    for turn_id, rects in bars:
        r, w = by_id[turn_id], dict(rects)  # a part of no width has no rect (a loaded machine may deliver a
        # stream in one read: its decode_s is 0)
        assert abs(w.get("ttft", 0.0) - r["ttft_s"] * per_s) <= 0.051, (r["ttft_s"], rects)
        assert abs(w.get("decode", 0.0) - r["decode_s"] * per_s) <= 0.051, (r["decode_s"], rects)
        if r["total_s"] == longest:  # the longest turn spans the whole bar
            assert abs(sum(v for k, v in rects if k in ("ttft", "decode", "rest")) - longest * per_s) <= 0.16
        for field, name in zip(PART_FIELDS, ("system", "tools", "history", "new")):
            assert r[field] > 0 and abs(w[f"part part-{name}"] - r[field] * per_tok) <= 0.051, (field, r[field])
        if r["prompt_tokens"] == largest:
            assert abs(sum(v for k, v in rects if k.startswith("part")) - largest * per_tok) <= 0.25
    # distributions: every streamed turn in exactly its bin; totals are report --json's n
    for key in ("ttft_s", "decode_tps", "tokens_per_chunk"):
        drawn = page.eval_on_selector_all(f".dist-{key} rect.bin", "rs => rs.map(r => [+r.dataset.count, "
                                          "+r.dataset.lo, +r.dataset.hi])")
        values = [r[key] for r in streamed if r[key] is not None]
        top = max(hi for _, _, hi in drawn)
        assert sum(c for c, _, _ in drawn) == report["user"][key]["n"] == len(values), key
        for count, lo, hi in drawn:
            assert count == sum(lo <= v < hi or (hi == top and v == hi) for v in values), (key, lo, hi)
    assert report["user"]["tokens_per_chunk"]["median"] > 1.5  # several tokens per chunk, not always 1.00
    assert sum(1 for _ in page.query_selector_all(".dist-tokens_per_chunk rect.bin")) >= 2  # nor one for all
    # the operating point: completed turns per level in flight
    levels = dict(page.eval_on_selector_all(".dist-concurrency rect.level",
                                            "rs => rs.map(r => [+r.dataset.concurrency, +r.dataset.count])"))
    assert levels == dict(Counter(int(r["concurrency"]) for r in ok))
    assert 1 in levels and max(levels) >= 2 and sum(levels.values()) == report["operating_point"]["concurrency"]["n"]
    # throughput over time: each turn in the slot of wall time it started in (SLOTS equal slots from the
    # first start to the last); per stream the slot's median decode speed over its streamed turns,
    # aggregate its delivered tokens over the time at least one of its turns was in flight
    t0, t1 = ok[0]["t_wall"], ok[-1]["t_wall"]
    width = max((t1 - t0) / SLOTS, 1e-9)
    slots: dict[int, list[dict]] = {}
    for r in ok:
        slots.setdefault(min(int((r["t_wall"] - t0) / width), SLOTS - 1), []).append(r)
    want_agg = [(t0 + (i + 0.5) * width, sum(r["completion_tokens"] for r in cell)
                 / _busy([(r["t_wall"], r["t_wall"] + r["total_s"]) for r in cell])) for i, cell in sorted(slots.items())]
    want_per = [(t0 + (i + 0.5) * width, _median([r["decode_tps"] for r in cell if r["streamed"] == 1]))
                for i, cell in sorted(slots.items()) if any(r["streamed"] == 1 for r in cell)]
    for cls, want in (("aggregate", want_agg), ("per-stream", want_per)):
        dots = page.eval_on_selector_all(f".timeline circle.{cls}", "cs => cs.map(c => [+c.dataset.x, +c.dataset.value, "
                                         "+c.getAttribute('cx'), +c.getAttribute('cy')])")
        assert len(dots) == len(want) >= 2, cls
        for (x, v, _, _), (wx, wv) in zip(dots, want):
            assert _close(x, wx, 1e-6) and _close(v, wv, 1e-6), (cls, (x, v), (wx, wv))
        line = " ".join(page.eval_on_selector_all(f".timeline polyline.{cls}",
                                                  "ps => ps.map(p => p.getAttribute('points'))")).split()
        assert line == [f"{cx:.1f},{cy:.1f}" for _, _, cx, cy in dots]  # the lines drawn go through them
        ranked = sorted(dots, key=lambda d: d[1])
        assert all(a[3] >= b[3] for a, b in zip(ranked, ranked[1:]))  # higher values drawn higher
    # the whole-turn speedup curve: report --json's speedups on it, and its ceiling drawn and said
    curve = dict(page.eval_on_selector_all(".speedup circle.curve", "cs => cs.map(c => [c.dataset.x, +c.dataset.value])"))
    for s, v in report["whole_turn"]["speedups"].items():
        assert _close(curve[repr(float(s))], v, 1e-12), s
    ceiling = report["whole_turn"]["max_speedup"]
    assert _close(float(page.get_attribute(".speedup .ceiling", "data-value")), ceiling, 1e-12)
    assert f"ceiling {ceiling:.2f}x" in page.text_content(".speedup .ceiling text")
    _inside(page, ".speedup .ceiling text")
    _inside(page, ".dist text.mark")  # the median and p95 labels: inside their chart, apart


def _check_server(page, report: dict) -> None:
    """Generated, accepted-draft and delivered tokens/s drawn as report --json has them; MAL said."""
    w = report["server"]["window"]
    assert w["mal"] > 1.5  # drafts were accepted: a speculative server
    per = float(page.get_attribute(".server", "data-px-per-tps"))
    bars = page.eval_on_selector_all(".server rect.rate", "rs => rs.map(r => [r.dataset.figure, r.dataset.value, "
                                     "+r.getAttribute('width')])")
    assert [f for f, _, _ in bars] == [f"server/window/{k}" for k in ("generated_tps", "accepted_draft_tps",
                                                                      "delivered_tps")]
    if w["coarse"]:  # more than 10% of the span outside the turns: no rates, said in the chart's title
        assert w["accepted_tokens"] > 0 and all(value == "" and width == 0 for _, value, width in bars)
        assert "outside the turns: coarse scrapes, no rates" in page.text_content(".server")
        return
    assert w["accepted_draft_tps"] > 0
    for figure, value, width in bars:
        value = float(value)
        assert _close(value, _lookup(report, figure), 1e-12) and width > 0 and abs(width - value * per) <= 0.051
    mal = page.get_attribute("[data-figure='server/window/mal']", "data-value")
    assert _close(float(mal), w["mal"], 1e-12)


def test_the_live_page_draws_the_turns_and_updates_live(make_stack, tiktoken_tok, chromium):
    stack = make_stack(tiktoken_tok, admin_token=TOKEN, scrape_interval_s=0.2)
    stack.service.admin.pages = LivePages(stack.cfg.db)  # what `specproxy serve` composes in
    stack.upstream.script = _speculative(tiktoken_tok)
    n = _traffic(stack)
    _committed(stack, n)
    browser = chromium()
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    assert page.goto(stack.url + "/_specproxy/").status == 401  # admin_token set: none presented
    page.goto(stack.url + f"/_specproxy/?token={TOKEN}")  # the page's event stream carries it on
    page.wait_for_selector("body:not([data-updates='0'])")  # the event stream delivered its first picture
    assert page.locator(".turns .turn").count() == n
    since = float(page.get_attribute(".window", "data-window-since"))  # the window the page draws
    report = _report_json(stack.cfg.db, "--since", repr(since))
    # the figures on the page are report --json's (the server's counters move with each scrape: not compared)
    assert _check_figures(page, report, skip="server/") >= 25
    _check_charts(page, _rows(stack.cfg.db, since), report)
    page.evaluate("window.notReloaded = true")
    stack.run(stack.service.watch.stop())  # the counters still now: the server's figures can be compared
    _conversation(stack, 1)
    _committed(stack, n + 1)
    page.wait_for_function(f"document.querySelectorAll('.turns .turn').length === {n + 1}", timeout=20_000)
    assert page.evaluate("window.notReloaded") is True  # the same page, updated by its event stream
    assert re.fullmatch(r"live: updated \d\d:\d\d:\d\d UTC", page.text_content("#status")), page.text_content("#status")
    since = float(page.get_attribute(".window", "data-window-since"))  # moves with the clock
    report = _report_json(stack.cfg.db, "--since", repr(since))
    assert _check_figures(page, report) >= 30
    _check_charts(page, _rows(stack.cfg.db, since), report)
    _check_server(page, report)
    last = page.locator(".turns .turn").last
    turn_id = last.get_attribute("data-turn-id")
    last.click()
    assert page.locator("#record").get_attribute("data-turn-id") == turn_id
    assert turn_id in page.locator("#record").inner_text()
    assert "tokens per second" not in page.content() and "sk-test" not in page.content()  # no text, no keys
    assert TOKEN not in page.inner_text("body")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "live-page.png"), full_page=True)
    page.close()


def test_the_html_report_of_a_window_opens_offline_with_the_same_figures(make_stack, tiktoken_tok, chromium,
                                                                          tmp_path):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.2)
    stack.upstream.script = _speculative(tiktoken_tok)
    _conversation(stack, 2, label="other")  # outside the window: another label
    _conversation(stack, 1, label="arm")  # outside the window: before --since
    _committed(stack, 3)
    # a scrape just before the window's first turn and one just after its last: the report's span of the
    # server's counters is theirs, a few ms wider than the turns (not coarse: its rates are drawn)
    stack.run(stack.service.watch.scrape_now())
    n = _traffic(stack, label="arm")
    _committed(stack, n + 3)
    stack.run(stack.service.watch.scrape_now())
    assert wait_for(lambda: len(stack.service.watch.recent) >= 3)  # the server's counters, scraped
    stack.run(stack.service.watch.stop())
    stack.service.writer.close()  # every turn and scrape is in the file: both reports read the same rows
    db = stack.cfg.db
    since = _rows(db, label="arm")[1]["t_wall"]
    window = ("--label", "arm", "--since", repr(since))
    html = tmp_path / "report.html"
    subprocess.run([SPECPROXY, "report", "--db", db, "--html", str(html), "--no-cache", *window], capture_output=True,
                   timeout=60, check=True)
    report = _report_json(db, *window)
    rows = _rows(db, since, label="arm")
    empty = tmp_path / "empty.html"  # a window with no turns says why, as the text report does
    subprocess.run([SPECPROXY, "report", "--db", db, "--html", str(empty), "--no-cache", "--label", "no-such-arm"],
                   capture_output=True, timeout=60, check=True)
    assert "no turns in this window (label no-such-arm); the database holds " in empty.read_text()
    assert report["turns"] == len(rows) == n
    conn = connect(db, readonly=True)  # before the browser: its event loop runs in this thread
    try:
        snap = snapshot(SQLiteSource(conn), source=db, label="arm", since=since)
    finally:
        conn.close()
    context = chromium().new_context(offline=True)
    fetched: list[str] = []
    context.on("request", lambda r: fetched.append(r.url))
    page = context.new_page()
    page.goto(html.as_uri())
    assert fetched == [html.as_uri()]  # nothing but the file itself
    assert page.locator(".turns .turn").count() == n
    assert page.get_attribute(".window", "data-window-label") == "arm"
    assert float(page.get_attribute(".window", "data-window-since")) == since
    assert _check_figures(page, report) >= 30
    _check_charts(page, rows, report)
    _check_server(page, report)
    page.locator(".turns .turn").first.click()
    assert page.locator("#record").get_attribute("data-turn-id") == page.locator(".turns .turn").first.get_attribute(
        "data-turn-id")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "html-report.png"), full_page=True)
    # the labels' worst cases: median and p95 equal, at either edge of their histogram
    for key, edge in (("ttft_s", 0), ("decode_tps", -1), ("tokens_per_chunk", -1)):
        at = snap["pictures"]["distributions"][key]["edges"][edge]
        snap["report"]["user"][key].update(median=at, p95=at)
    page.set_content(document(snap, live=False, title="labels at the edges"))
    _inside(page, ".dist text.mark")
    context.close()


def test_the_live_page_shows_the_prefix_cache_and_a_clicked_turns_change(make_stack, tiktoken_tok, chromium):
    """Three turns of one conversation on a server that says its cached count in llama.cpp's
    ``timings.cache_n``; the third's cache was evicted (0 reused). The page's prefix-cache figures are
    ``report --json``'s, and clicking the third turn says what changed against the second: each part's
    tokens (computed here from the database's rows) and the lost tokens."""
    stack = make_stack(tiktoken_tok, admin_token=TOKEN)
    stack.service.admin.pages = LivePages(stack.cfg.db)
    db = stack.cfg.db
    cached: dict[int, int] = {}  # messages in the request -> cache_n the fake says
    stack.upstream.script = lambda req: Script(pieces=["Done", "."], ttft_s=0.01, usage="none", timings=True,
                                               cache_n=cached.get(len(req["messages"]), 0))
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0, timeout=30)
    history: list[dict] = []
    for i in range(3):
        history.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *history]
        if i == 1:  # the second turn reuses all the first turn's prompt
            cached[len(messages)] = _rows(db)[0]["prompt_tokens"]
        for _ in client.chat.completions.create(model="m", stream=True, tools=TOOLS, messages=messages):
            pass
        _committed(stack, i + 1)
        history.append({"role": "assistant", "content": "Done."})
    rows = _rows(db)
    assert [r["usage_cached_tokens"] for r in rows] == [0, rows[0]["prompt_tokens"], 0]
    lost = rows[2]["prefix_reused_tokens"]
    assert lost > 0 and len({r["session"] for r in rows}) == 1

    browser = chromium()
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.goto(stack.url + f"/_specproxy/?token={TOKEN}")
    page.wait_for_selector("body:not([data-updates='0'])")
    since = float(page.get_attribute(".window", "data-window-since"))
    report = _report_json(db, "--since", repr(since))
    assert report["prefix_cache"]["lost_tokens"] == lost and report["prefix_cache"]["turns"] == 2
    _check_figures(page, report, skip="server/")
    shown = page.eval_on_selector_all(".prefix-cache [data-figure]", "els => els.map(e => e.dataset.figure)")
    assert {"prefix_cache/lost_tokens", "prefix_cache/predicted_tokens", "prefix_cache/reused_tokens"} <= set(shown)
    assert page.get_attribute("[data-figure='prefix_cache/lost_tokens']", "data-value") == repr(float(lost))

    third = page.locator(".turns .turn").last
    third.click()
    change = page.locator("#turn-change")
    assert change.get_attribute("data-turn-id") == third.get_attribute("data-turn-id") == rows[2]["id"]
    d = {p: rows[2][f"prompt_{p}_tokens"] - rows[1][f"prompt_{p}_tokens"] for p in ("system", "tools", "history", "new")}
    assert d["history"] > 0 and d["system"] == 0 and d["tools"] == 0
    text = change.inner_text()
    assert (f"tokens system +0, tools +0, history {d['history']:+,}, new {d['new']:+,} "
            f"(prompt {rows[2]['prompt_tokens'] - rows[1]['prompt_tokens']:+,})") in text
    assert "messages +2 -0" in text and f"server reused 0, lost {lost:,}" in text
    page.locator(".turns .turn").first.click()
    assert page.locator("#turn-change").inner_text().startswith("no previous turn of this session known")
    page.close()
