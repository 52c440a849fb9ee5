"""A whole (not streamed) response body over ``max_counted_bytes`` is not parsed (issue 32, "Memory": a JSON
parser copies the body and makes its text beside it, about three times its size at once): its text's
figures are null and say why, and the server's usage and timings are read by a byte search."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.measure.build import build_record
from specproxy.measure.texts import object_of_key
from specproxy.measure.turn_recorder import TurnRecorder

USAGE = {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46,
         "prompt_tokens_details": {"cached_tokens": 8}}


def _turn(body: bytes, max_counted: int) -> TurnRecorder:
    req = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=req, t_wall=1.0, t_request=0.5,
                      max_counted=max_counted)
    b.on_headers(0.6, 200, "application/json")
    for i in range(0, len(body), 1000):
        b.on_bytes(body[i:i + 1000], 1.0 + i / 1e6, 1.0 + i / 1e6)
    b.finish(2.0)
    return b


def _answer(text: str) -> bytes:
    return orjson.dumps({"id": "c", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}],
                         "usage": USAGE, "timings": {"cache_n": 8, "prompt_n": 4}})


@pytest.mark.parametrize("text", ["the cache was warm. " * 500, 'a "usage": {"x": 1} inside the text, and }{ too ' * 60])
def test_a_body_over_the_limit_is_read_for_its_accounting_only(text, tiktoken_tok):
    body = _answer(text)
    tok = tiktoken_tok
    over = build_record(_turn(body, max_counted=len(body) - 1), tok)
    assert "response_over_max_counted_bytes" in over.measure_capped_reason and over.measure_capped
    assert over.completion_tokens is None and over.content_class is None  # unknown, not zero
    assert (over.usage_prompt_tokens, over.usage_completion_tokens, over.usage_cached_tokens) == (12, 34, 8)
    assert over.ttft_s == pytest.approx(whole_ttft(body)) and over.outcome == "ok"

    within = build_record(_turn(body, max_counted=len(body)), tok)  # at the limit: parsed as ever
    assert within.measure_capped_reason is None and within.completion_tokens > 0
    assert (within.usage_prompt_tokens, within.usage_completion_tokens) == (12, 34)
    assert within.ttft_s == over.ttft_s


def whole_ttft(body: bytes) -> float:
    """The answer is usable when its last read arrived (``_turn``'s timing), from the request at 0.5."""
    last = (len(body) - 1) // 1000 * 1000
    return 1.0 + last / 1e6 - 0.5


def test_the_one_key_is_found_and_a_key_inside_a_string_is_not():
    assert object_of_key(b'{"a":"\\"usage\\":{\\"x\\":1}","usage":{"p":{"q":"}"},"n":2}}', b"usage") == {
        "p": {"q": "}"}, "n": 2}
    # a key whose name ends in an escaped quote and "usage": the match there starts at an escaped quote
    assert object_of_key(b'{"a\\"usage":{"n":1},"usage":{"n":2}}', b"usage") == {"n": 2}
    assert object_of_key(b'{"usage":{"n":1},"x":{"usage":{"n":2}}}', b"usage") is None  # two: which one?
    assert object_of_key(b'{"usage":[1]}', b"usage") is None and object_of_key(b'{"usage":{"n":', b"usage") is None
    assert object_of_key(b'{"timings" : {"cache_n": 3}}', b"timings") == {"cache_n": 3}
    assert object_of_key(b'{"text":"no key here"}', b"usage") is None


_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(alphabet='ab"\\{}: u', max_size=6),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='ab"{}u', max_size=4),
                                                                                  inner, max_size=3), max_leaves=8)


@settings(max_examples=examples(300), deadline=None)
@given(usage=st.dictionaries(st.text(alphabet='ab"{}', max_size=4), _VALUES, max_size=4),
       before=st.dictionaries(st.text(alphabet='ab"{}', max_size=4).filter(lambda k: k != "usage"), _VALUES, max_size=3))
def test_the_object_found_is_the_one_the_parser_reads(usage, before):
    """Whatever strings hold (quotes, braces, backslashes, the key's own name), the object found by the
    byte search is the one a JSON parser reads under the top-level key."""
    body = orjson.dumps({**before, "usage": usage})
    nested = orjson.dumps(before)
    expected = usage if b'"usage"' not in nested else None  # a second "usage" key deeper in: refused
    if expected is None:
        assert object_of_key(body, b"usage") in (None, usage)
    else:
        assert object_of_key(body, b"usage") == expected
