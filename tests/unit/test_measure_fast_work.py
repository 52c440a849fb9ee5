"""What the fast stream parse does not do: parse, derive templates or look at events more than it needs
to, which only its speed would show; and the rules of the templates' reading (escaped bodies, where a
template is safe) at their edges. Every read here is also checked equal to the reference parse; the
differential tests on random streams are in test_measure_fast.py.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.measure import chunk_templates, fast_texts
from specproxy.measure import texts as texts_mod
from measurekit import counting_loads


class _Watch:
    """Counts what ``_stream_texts_fast`` does: chunk parses (not those of escaped bodies, as strings),
    template derivations, and the windows of events its runs read."""

    def __init__(self, monkeypatch) -> None:
        self.loads = counting_loads(monkeypatch)
        self.parses = 0
        self.derivations = 0
        self.windows: list[tuple[int, int]] = []
        derive, run = fast_texts._content_template, chunk_templates._Template.run

        def counted_derive(*args):
            self.derivations += 1
            return derive(*args)

        def recorded_run(tmpl, segs, i, j, buf, pos):
            self.windows.append((i, j))
            return run(tmpl, segs, i, j, buf, pos)

        monkeypatch.setattr(fast_texts, "_content_template", counted_derive)
        monkeypatch.setattr(chunk_templates._Template, "run", recorded_run)
        self.c_runs: list[int] = []  # the C path: events each template_run call read
        if fast_texts._scanc is not None:
            scanc, runs = fast_texts._scanc, self.c_runs

            class _Recorded:
                join_frames = staticmethod(scanc.join_frames)
                chunk_gaps = staticmethod(scanc.chunk_gaps)

                @staticmethod
                def template_run(*args):
                    out = scanc.template_run(*args)
                    runs.append(out[0])
                    return out

            monkeypatch.setattr(fast_texts, "_scanc", _Recorded)

    def read(self, reads: list[bytes], scan: str):
        """``reads`` parsed by the fast path with Config ``scan``'s scans (checked equal to the reference)."""
        times = [float(i) for i in range(len(reads))]
        fast = fast_texts._stream_texts_fast(reads, times, c_scans=scan == "c")
        self.parses = sum(1 for data in self.loads if data[:1] in (b"{", "{"))
        assert fast is not None and fast == texts_mod.stream_texts_reference(reads, times)
        return fast


CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":%d,"delta":{"content":"%b"},"finish_reason":null}]}\n\n')
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
CLOSING = [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
           b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":300}}\n\n', b"data: [DONE]\n\n"]


def test_a_long_run_is_read_in_few_windows(monkeypatch, each_scan):
    """Windows double while the run lasts, and stop before the closing chunks; escapes do not end it.
    In C the run is one call; the closing chunks each cost a call that reads none."""
    words = [b" w%d" % i if i % 7 else b"\\n" for i in range(300)]
    reads = [ROLE, *(CHUNK % (0, w) for w in words), *CLOSING]
    watch = _Watch(monkeypatch)
    monkeypatch.setattr(fast_texts, "_WINDOWS", (4, 16))
    fast = watch.read(reads, each_scan)
    assert fast.chunks == 300 and fast.finish_reason == "stop" and fast.usage
    if each_scan == "python":
        assert [j - i for i, j in watch.windows] == [16, 32, 64, 128, 59]  # from event 2: the first derives
        assert watch.windows[-1][1] == 1 + len(words)  # not into the closing chunks
    else:
        assert watch.c_runs == [len(words) - 1, 0, 0, 0] and not watch.windows
    assert watch.parses <= 6  # the role chunk, the first content (and its probe), the closing ones


def test_a_window_that_continues_a_run_checks_its_first_chunk(monkeypatch):
    """The first chunk of a window after a full one is not known to be the template's: another
    choice's chunk there starts no run of the first one's."""
    words = [b" w%d" % i for i in range(300)]
    reads = [ROLE, *(CHUNK % (int(k == 258), w) for k, w in enumerate(words, 1)), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads, "python")
    assert fast.texts[(1, "content")] == " w257" and watch.windows[1][0] == 258


def test_shapes_taking_turns_cost_little(monkeypatch):
    """Two choices' chunks in turn (each its own shape) thrash one template: derivations stop after a few
    (only a run long enough refills them), runs start with small windows, other shapes start none."""
    reads = [CHUNK % (i % 2, b" w%d" % i) for i in range(200)]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads, "python")
    assert sorted(fast.texts) == [(0, "content"), (1, "content")]
    assert watch.derivations <= 4
    assert len(watch.windows) <= 100  # only events of the template's shape start a run
    assert sum(j - i for i, j in watch.windows) <= 256 + 4 * 100  # the first window, then short ones


@pytest.mark.parametrize("contents", [[b" a", b" b", b"", b""], [b" a", b"", b""]])
def test_a_run_ending_in_empty_content_is_timed_by_its_last_text(each_scan, contents):
    reads = [ROLE, *(CHUNK % (0, c) for c in contents), *CLOSING]
    times = [float(i) for i in range(len(reads))]
    fast = fast_texts._stream_texts_fast(reads, times, c_scans=each_scan == "c")
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
    values = list(map(_string, bodies))
    ok = (values + [None]).index(None)
    assert chunk_templates._escaped_bodies(b"\n".join(bodies)) == ("".join(values[:ok]), ok)


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
    fast = watch.read(reads, "python")
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
def test_templates_are_found_where_they_are_safe(each_scan, monkeypatch, chunk):
    reads = [ROLE, *(chunk(i, b" w%d" % i) for i in range(60)), *CLOSING]
    watch = _Watch(monkeypatch)
    fast = watch.read(reads, each_scan)
    assert fast.chunks == 60
    assert watch.parses <= 8
