"""What the chat stream's native reader does not do: parse, derive templates or look at events more than
it needs to, which only its speed would show; and the rules of the templates' reading (escaped bodies,
where a template is safe) at their edges. Every read here is also checked equal to the reference
parse; the differential tests on random streams are in test_measure_fast.py.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.measure import fast_texts
from specproxy.measure import texts as texts_mod
from measurekit import counting_loads, needs_native, read_native

pytestmark = needs_native


class _Watch:
    """Counts what ``read_chat_stream`` does: chunk parses (not those of escaped bodies, as strings),
    template derivations, and the events each ``template_run`` call read."""

    def __init__(self, monkeypatch) -> None:
        self.loads = counting_loads(monkeypatch)
        self.parses = 0
        self.derivations = 0
        derive = fast_texts.content_template

        def counted_derive(*args):
            self.derivations += 1
            return derive(*args)

        monkeypatch.setattr(fast_texts, "content_template", counted_derive)
        self.c_runs: list[int] = []  # events each template_run call read
        scanc, runs = fast_texts.scans, self.c_runs

        class _Recorded:
            join_frames = staticmethod(scanc.join_frames)
            chunk_gaps = staticmethod(scanc.chunk_gaps)

            @staticmethod
            def template_run(*args):
                out = scanc.template_run(*args)
                runs.append(out[0])
                return out

        monkeypatch.setattr(fast_texts, "scans", _Recorded)

    def read(self, reads: list[bytes]):
        """``reads`` read by the native reader (checked equal to the reference)."""
        times = [float(i) for i in range(len(reads))]
        fast = read_native(reads, times)
        self.parses = sum(1 for data in self.loads if data[:1] in (b"{", "{"))
        assert fast is not None and fast == texts_mod.stream_texts_reference(reads, times)
        return fast


CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":%d,"delta":{"content":"%b"},"finish_reason":null}]}\n\n')
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
CLOSING = [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
           b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":300}}\n\n', b"data: [DONE]\n\n"]


def test_a_long_run_is_read_in_one_call(monkeypatch):
    """The run (from event 2: the first derives) is one call, which stops before the closing chunks;
    escapes do not end it. The closing chunks each cost a call that reads none."""
    words = [b" w%d" % i if i % 7 else b"\\n" for i in range(300)]
    reads = [ROLE, *(CHUNK % (0, w) for w in words), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads)
    assert fast.chunks == 300 and fast.finish_reason == "stop" and fast.usage
    assert watch.c_runs == [len(words) - 1, 0, 0, 0]
    assert watch.parses <= 6  # the role chunk, the first content (and its probe), the closing ones


def test_another_choice_s_chunk_ends_a_run(monkeypatch):
    """A chunk of another choice inside a run of the first one's is no event of its template: the run
    stops before it, and its text goes to its own choice."""
    words = [b" w%d" % i for i in range(300)]
    reads = [ROLE, *(CHUNK % (int(k == 258), w) for k, w in enumerate(words, 1)), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads)
    assert fast.texts[(1, "content")] == " w257" and watch.c_runs[0] == 256  # events 2 to 257


def test_shapes_taking_turns_cost_little(monkeypatch):
    """Two choices' chunks in turn (each its own shape) thrash one template: derivations stop after a few
    (only a run long enough refills them), and each event costs at most one call that reads it."""
    reads = [CHUNK % (i % 2, b" w%d" % i) for i in range(200)]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads)
    assert sorted(fast.texts) == [(0, "content"), (1, "content")]
    assert watch.derivations <= 4
    assert len(watch.c_runs) <= 200 and sum(watch.c_runs) <= 200


@pytest.mark.parametrize("contents", [[b" a", b" b", b"", b""], [b" a", b"", b""]])
def test_a_run_ending_in_empty_content_is_timed_by_its_last_text(contents):
    reads = [ROLE, *(CHUNK % (0, c) for c in contents), *CLOSING]
    times = [float(i) for i in range(len(reads))]
    fast = read_native(reads, times)
    assert fast == texts_mod.stream_texts_reference(reads, times)
    texts = sum(map(bool, contents))
    assert (fast.t_first, fast.t_last, fast.chunks) == (1.0, float(texts), texts)


def _string(body: bytes) -> str | None:
    """What the reference reads from a content string written ``body``, or None: not a string."""
    try:
        value = orjson.loads('"' + body.decode("utf-8", "replace") + '"')
    except ValueError:
        return None
    return value


@settings(max_examples=examples(500), deadline=None)
@given(bodies=st.lists(st.lists(st.sampled_from([b"a", b"\\", b'"', b",", b"]", b"1", b"n", b"u00e9", b"ud800", b"\xff",
                                                 b"\x01", b"\xe6\x97", "é".encode()]), max_size=6).map(b"".join),
                       min_size=1, max_size=5))
def test_escaped_bodies_read_each_as_its_own_string(bodies):
    """A run's bodies, escaped or not, each read as the string the reference reads (a body that is none
    is a bad event): the run stops before the first that is none, and the rest is read one by one."""
    words = [b" w%d" % i for i in range(3)]
    reads = [ROLE, *(CHUNK % (0, w) for w in [*words, *bodies, *words]), *CLOSING]
    times = [float(i) for i in range(len(reads))]
    fast = read_native(reads, times)
    assert fast is not None and fast == texts_mod.stream_texts_reference(reads, times)
    values = list(map(_string, bodies))
    if None not in values:
        plain = "".join(map(bytes.decode, words))
        assert fast.bad_events == 0 and fast.texts[(0, "content")] == plain + "".join(values) + plain


@pytest.mark.parametrize(("bodies", "bad"), [
    ([b'a","b'], 1),  # an unescaped quote: two strings in the array for one body
    ([b"x\\", b",1", b"y\\"], 2),  # backslashes that escape the quote after their body
    ([b"C:\\\\", b'\\"q\\"'], 0),  # escaped backslashes and quotes: one JSON string each
])
def test_escaped_bodies_are_each_one_string(monkeypatch, bodies, bad):
    """Bodies with escapes are parsed as the strings of one JSON array only when each is one string;
    then that costs one parse, not one per body."""
    words = [b" w%d" % i for i in range(20)]
    reads = [ROLE, *(CHUNK % (0, w) for w in words[:10] + bodies + words[10:]), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads)
    assert fast.bad_events == bad
    if not bad:
        assert not [data for data in watch.loads if isinstance(data, str) and data.startswith('"')]


@pytest.mark.parametrize("chunk", [
    # the first contents are escaped: the template is cut around the escaped string
    lambda i, w: CHUNK % (0, b"\\n\\u00e9" if i < 4 else w),
    # a key ending in "content" whose quote is escaped, with the first contents' value, before the delta
    lambda i, w: b'data: {"a\\"content":"x","choices":[{"index":0,"delta":{"content":"%b"}}]}\n\n' % (w if i > 2 else b"x"),
    # a duplicate key: the last one is the content
    lambda i, w: b'data: {"choices":[{"index":0,"delta":{"content":"a","content":"%b"}}]}\n\n' % w,
    # a digit run that is no number of the allowed shape (a leading zero): no varying number, one template
    lambda i, w: b'data: {"choices":[{"index":0,"delta":{"content":"%b"}}],"sig":"s0123"}\n\n' % w,
])
def test_templates_are_found_where_they_are_safe(monkeypatch, chunk):
    reads = [ROLE, *(chunk(i, b" w%d" % i) for i in range(60)), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads)
    assert fast.chunks == 60
    assert watch.parses <= 8
