"""``specproxy demo``: the whole job on a machine with no inference server.

It starts the package's own scripted upstream (behaving like a speculative-decoding server: several
tokens per chunk, a prefill time that grows with the prompt, a slower decode step when more requests
share it, llama.cpp-style counters at /metrics; without a prefix cache, so the tokens the client
prepends are prefilled every turn and its counters report no cache hit), the real proxy in front of it,
and a client that chats the way a real chat client does (a long system prompt and tool definitions
prepended to every turn, a growing history), first alone and then with company. Then it prints the real
report of what was measured. Nothing is faked after the upstream: the proxy, the measuring and the store
are the ones ``serve`` runs, and so is the live page at ``/_specproxy/`` (drawn from the demo's database
while the traffic runs; ``linger`` keeps the proxy up after it, for ``specproxy demo --stay``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from specproxy.config import load_config
from specproxy.serve.service import Service
from specproxy.app.fake_upstream import FakeUpstream, Script, pieces_of
from specproxy.measure.tokens import load_tokenizer
from specproxy.view.live import LivePages

__all__ = ["run_demo"]

SYSTEM_PROMPT = (
    "You are a careful assistant inside a coding workspace. Follow the user's instructions exactly. "
    "Prefer short, correct answers; cite files by path; never invent APIs; ask when a request is ambiguous. "
)
ANSWERS = (
    "The ratio you quoted is aggregate throughput at concurrency 64, but your server sees one or two "
    "requests at a time, so per-stream decode speed is the figure to compare. At that operating point "
    "the new configuration decodes about forty percent faster, while time to first token is unchanged "
    "because prefill does not benefit from speculative decoding.",
    "def tokens_per_second(tokens, seconds):\n    if seconds <= 0:\n        return None\n"
    "    return tokens / seconds\n\nprint(tokens_per_second(377, 10.003))",
    "Your client prepends a long system prompt and thousands of tokens of tool definitions to every turn. "
    "That prefix is read before the first token appears, so the wait you feel is mostly prefill, and a "
    "faster decoder shortens only the part of the turn after the first token.",
)
QUESTIONS = (
    "Why does my chat client show 38 tok/s when the server says 74?",
    "Write a function that computes tokens per second.",
    "Is the new speculative decoding config worth it for prose?",
    "What should I measure before switching configs?",
)


def _tools(n: int = 24) -> list[dict]:
    rng = random.Random(7)
    words = ["path", "query", "limit", "recursive", "pattern", "encoding", "timeout", "branch", "message"]
    tools = []
    for i in range(n):
        props = {
            w: {"type": "string", "description": f"The {w} to use for operation {i}; see the workspace conventions."}
            for w in rng.sample(words, 4)
        }
        tools.append({"type": "function", "function": {
            "name": f"workspace_tool_{i}",
            "description": "Operates on the user's workspace: reads, searches or edits files and reports the result "
                           "in a structured form that the assistant can quote back to the user verbatim.",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:2]}}})
    return tools


def _script_for(upstream_ref: list[FakeUpstream], pieces: list[list[str]]) -> Callable[[dict], Script]:
    rng = random.Random(11)

    def script(request: dict) -> Script:
        up = upstream_ref[0]
        busy = max(up.processing, 1)  # a decode step is slower when more requests share it
        return Script(
            pieces=pieces[rng.randrange(len(pieces))],
            ttft_s=0.03,
            prefill_tps=40000.0,
            interval_s=0.006 * (1 + 0.35 * (busy - 1)) * rng.uniform(0.85, 1.15),
            tokens_per_chunk=(1, 3, 2, 4, 2, 1, 3),  # speculative decoding: accepted drafts + 1 per step
            drafts_per_chunk=3,
            usage="last",
            extra_usage_tokens=1,  # like a server that counts the end-of-turn token
            timings=True,
        )

    return script


async def _client(proxy_url: str, turns: int, tools: list[dict], system: str, seed: int) -> int:
    rng = random.Random(seed)
    history: list[dict] = []
    errors = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(turns):
            question = rng.choice(QUESTIONS)
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
            body = {"model": "demo-model", "stream": True, "messages": messages, "tools": tools,
                    "stream_options": {"include_usage": True}}
            answer = []
            async with session.post(f"{proxy_url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    errors += 1
                    continue
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"content"' in line:
                        answer.append(line)  # a real client would render it
            await asyncio.sleep(rng.uniform(0.02, 0.06))  # the person reads the answer before typing again
            history += [{"role": "user", "content": question},
                        {"role": "assistant", "content": rng.choice(ANSWERS)}]
            history = history[-8:]
    return errors


async def run_demo(db: str | Path, *, turns: int = 8, levels: tuple[int, ...] = (1, 4),
                   tokenizer: str = "tiktoken:o200k_base", progress: Callable[[str], None] = print,
                   linger: Callable[[str], Awaitable[None]] | None = None) -> Path:
    """Run the demo traffic into ``db``; return its path. ``linger`` is awaited with the proxy's URL after
    the traffic, every turn measured, before the proxy stops (its live page is served until it returns)."""
    tok = load_tokenizer(tokenizer)
    pieces = [pieces_of(a, tok) for a in ANSWERS]
    ref: list[FakeUpstream] = []
    upstream = FakeUpstream(_script_for(ref, pieces), model="demo-model")
    ref.append(upstream)
    await upstream.start()
    cfg = load_config(env={}, overrides={"upstream": upstream.url, "port": 0, "db": str(db),
                                          "tokenizer": tokenizer, "label": "demo", "scrape_interval_s": 0.25})
    service = Service(cfg=cfg, tokenizer=tok)
    from specproxy.store.writer import Writer

    service.writer = Writer(cfg.db, queue_size=cfg.queue_size, scrape_retention_days=cfg.scrape_retention_days)
    service.pages = LivePages(cfg.db, writer=service.writer)  # the live page, as serve has it
    await service.start()
    # said up front: the report's prefix-cache line reads 0% of this server, which would look like a bug
    progress(f"demo: scripted upstream at {upstream.url} (no prefix cache: it prefills every prompt whole), "
             f"specproxy at {service.url}, database {db}\n"
             f"demo: live page {service.url}/_specproxy/, Prometheus {service.url}/_specproxy/metrics")
    tools = _tools()
    system = SYSTEM_PROMPT * 12
    try:
        for level in levels:
            t0 = time.monotonic()
            results = await asyncio.gather(*(_client(service.url, turns, tools, system, seed=level * 100 + i)
                                             for i in range(level)))
            progress(f"demo: {level * turns} turn{'' if level * turns == 1 else 's'} at concurrency {level} in {time.monotonic() - t0:.1f} s"
                     + (f" ({sum(results)} errors)" if sum(results) else ""))
        assert service.proxy is not None
        await service.proxy.drain_measurements()
        if service.watch is not None:  # a scrape after the last turn: the report's counters span all of them
            await service.watch.scrape_now()
        if linger is not None:
            await linger(service.url)
    finally:
        await service.stop()
        await upstream.close()
    return Path(db)
