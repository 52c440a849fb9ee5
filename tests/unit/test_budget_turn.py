"""A turn under the process's memory budget (``TurnRecorder``'s side of it): what a refused charge, a
shed prompt or response and ``max_counted_bytes`` leave in the record, and that letting go gives back
exactly what was charged. The process itself under load: tests/integration/test_memory_budget.py."""

from __future__ import annotations

import time

import orjson

from specproxy.measure.build import build_record
from specproxy.measure.tokens import PromptCounts
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.wire import memory

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
BODY = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello"}]})


class _Tok:
    """Counts one token per character; records what it was asked to count."""

    name = "fake"

    def __init__(self) -> None:
        self.prompts = 0

    def count(self, text: str) -> int:
        return len(text)

    def encode(self, text: str) -> list[int]:
        return list(map(ord, text))

    def token_ends(self, text: str) -> list[int]:
        return list(range(1, len(text) + 1))

    def count_prompt(self, parts) -> PromptCounts:
        self.prompts += 1
        return PromptCounts(total=5, system=0, tools=0, history=0, new=5)


def _turn(body: bytes = BODY, *, take=None, max_counted=None, reads: int = 4) -> TurnRecorder:
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=body, t_wall=time.time(), t_request=1.0,
                      take=take, body_charge=len(body), max_counted=max_counted)
    b.on_headers(1.1, 200, "text/event-stream")
    for i in range(reads):
        b.on_bytes(EVENT, 1.2 + i / 100, 1.2 + i / 100)
    b.on_bytes(b"data: [DONE]\n\n", 1.3, 1.3)
    b.finish(1.4)
    return b


def test_a_read_the_budget_refuses_ends_keeping_for_that_turn():
    """The budget refuses the third read: the first two are kept, no later one is (even if the budget has
    room again), and the record says the budget capped it."""
    answers = iter([True, True, False, True, True])
    b = _turn(take=lambda n, small: next(answers))
    assert len(b.reads) == 2 and b.budget_capped
    rec = build_record(b, None)
    assert rec.measure_capped and rec.measure_capped_reason == "response_memory_budget"
    assert rec.chunks == 2 and rec.request_bytes == len(BODY)


def test_the_per_turn_cap_says_so_apart_from_the_budget():
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=BODY, t_wall=time.time(), t_request=1.0,
                      max_bytes=len(EVENT))
    b.on_headers(1.1, 200, "text/event-stream")
    b.on_bytes(EVENT, 1.2, 1.2)
    b.on_bytes(EVENT, 1.3, 1.3)
    b.finish(1.4)
    rec = build_record(b, None)
    assert rec.measure_capped_reason == "response_over_max_measured_bytes"


def test_a_whole_turn_says_nothing():
    tok = _Tok()
    rec = build_record(_turn(), tok)
    assert not rec.measure_capped and rec.measure_capped_reason is None
    assert rec.prompt_tokens == 5 and rec.completion_tokens == 8 and tok.prompts == 1


def _charging(n: int, small: bool) -> bool:
    return True


def test_a_turn_without_a_budget_gives_back_only_its_body_charge():
    b = _turn()
    assert b.charged() == len(BODY) and b.let_go() == len(BODY) and b.charged() == 0


def test_a_shed_prompt_is_not_counted_and_its_charge_comes_back():
    tok = _Tok()
    b = _turn(take=_charging)
    assert b.charged() == len(BODY) + 4 * len(EVENT) + len(b"data: [DONE]\n\n")
    assert b.shed_prompt() == len(BODY) and b.body == b""
    rec = build_record(b, tok)
    assert tok.prompts == 0 and rec.prompt_tokens is None and rec.model is None
    assert rec.request_bytes == len(BODY)  # the size it had: forwarded whole
    assert rec.completion_tokens == 8  # the response is measured
    assert rec.measure_capped and rec.measure_capped_reason == "prompt_memory_budget"
    assert b.let_go() == 4 * len(EVENT) + len(b"data: [DONE]\n\n") and b.charged() == 0


def test_a_shed_response_is_not_read_as_zero_tokens():
    tok = _Tok()
    b = _turn(take=_charging)
    assert b.shed_response() == 4 * len(EVENT) + len(b"data: [DONE]\n\n")
    rec = build_record(b, tok)
    assert rec.completion_tokens is None and rec.prompt_tokens == 5 and rec.model == "m"
    assert rec.measure_capped_reason == "response_memory_budget"
    assert b.let_go() == len(BODY)


def test_max_counted_bytes_bounds_the_tokenizer_work_of_one_turn():
    tok = _Tok()
    rec = build_record(_turn(max_counted=len(BODY) - 1), tok)
    assert tok.prompts == 0 and rec.prompt_tokens is None
    assert rec.completion_tokens == 8  # 8 characters of completion: within the bound
    assert rec.measure_capped_reason == "prompt_over_max_counted_bytes" and rec.model == "m"
    assert not rec.request_parsed  # not parsed: a byte search found its model
    rec = build_record(_turn(max_counted=7), _Tok())
    assert rec.completion_tokens is None and rec.prompt_tokens is None
    assert rec.measure_capped_reason == "prompt_over_max_counted_bytes,completion_over_max_counted_bytes"


def test_the_counter_takes_within_its_limit_and_gives_back():
    before = memory.used()
    old = memory.limit()
    memory.set_limit(before + 100, before + 150)
    try:
        assert memory.take(60) and not memory.take(41) and memory.take(40)
        assert memory.used() == before + 100
        assert not memory.take(1) and memory.take(50, True) and not memory.take(1, True)
        memory.give(150)
        assert memory.used() == before
    finally:
        memory.set_limit(*old)


def test_the_model_of_a_prompt_too_large_to_parse_is_found_by_its_one_key():
    from specproxy.measure.request_body import model_only as _model_only

    assert _model_only(b'{"messages":[{"content":"x"}], "model" : "m-1"}') == "m-1"
    assert _model_only(b'{"model":"a\\"b"}') == 'a"b'  # an escaped quote inside the value
    # inside a string a key's quotes are escaped: not a key
    assert _model_only(b'{"messages":[{"content":"say \\"model\\":\\"x\\""}],"model":"real"}') == "real"
    # a key whose name ends in an escaped quote and "model": the match there starts at an escaped quote
    assert _model_only(b'{"a\\"model":"x","model":"real"}') == "real"
    assert _model_only(b'{"model":"a","tools":[{"model":"b"}]}') is None  # two: which is unknown
    assert _model_only(b'{"messages":[]}') is None and _model_only(b'{"model":1}') is None
    assert _model_only(b'{"model":"' + b"x" * 300 + b'"}') is None


def test_a_prompt_of_more_messages_than_are_counted_is_not_counted():
    """Counting costs per message too: 100,000 tiny messages within 4 MiB took seconds of a core. Past
    ``MAX_COUNTED_ITEMS`` messages and tools the prompt is not counted (the record says why); at it, it is."""
    from specproxy.measure.tokens import MAX_COUNTED_ITEMS

    def body(n: int) -> bytes:
        return orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}] * n})

    tok = _Tok()
    rec = build_record(_turn(body(MAX_COUNTED_ITEMS + 1)), tok)
    assert tok.prompts == 0 and rec.prompt_tokens is None and rec.request_parsed and rec.model == "m"
    assert rec.measure_capped and rec.measure_capped_reason == "prompt_over_max_counted_items"
    assert rec.completion_tokens == 8  # the response is still counted
    rec = build_record(_turn(body(MAX_COUNTED_ITEMS)), tok)
    assert tok.prompts == 1 and rec.prompt_tokens == 5 and rec.measure_capped_reason is None
