"""Content classes: code, prose and tool calls are told apart, deterministically."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.measure.content import _looks_like_code, classify


@pytest.mark.parametrize("content, tool_args, expected", [
    ("The ratio you quoted is aggregate throughput. Per-stream speed is what a user feels.", "", "prose"),
    ("Here:\n```python\nprint(1)\n```\n", "", "code"),
    ("def f(x):\n    return x * 2\n\nprint(f(3))", "", "code"),
    ("int main() {\n    return 0;\n}", "", "code"),
    ("", '{"city": "Paris"}', "tool_call"),
    ("ok", '{"path": "a/very/long/argument/list.txt", "recursive": true}', "tool_call"),
    ("", "", None),
    ("   \n", "", None),
])
def test_classify(content, tool_args, expected):
    assert classify(content, tool_args) == expected


# the line rule as first written: one regex searched across the line (a long line of prose was scanned at
# every position); _looks_like_code checks the same with anchored pieces
_CODE_LINE_REFERENCE = re.compile(
    r"^(?:\s{4,}\S|\t\S)|[;{}]\s*$|^\s*(?:def|class|import|from|return|if|elif|else|for|while|try|except|"
    r"#include|function|const|let|var|fn|pub|func|package|SELECT|public|private|static)\b"
)
_pieces = st.sampled_from(["def", "class ", "    x", "\tx", "  if", "return", ";", "{", "}", " ", "\t",
                           "\u2003", "\x1c", "word", "SELECT", "defx", "\u00a0;", "a;  ", "}\u3000", "#include"])


@settings(max_examples=examples(600), deadline=None)
@given(st.lists(st.one_of(_pieces, st.text(max_size=3)), max_size=30).map("".join))
def test_the_line_rule_equals_the_reference_regex(text):
    for line in text.splitlines():
        if line.strip():
            assert _looks_like_code(line) == bool(_CODE_LINE_REFERENCE.search(line)), repr(line)


def _classify_by_splitlines(content: str, tool_args: str = "") -> str | None:
    """The rule written plainly (every line copied at once): the reference ``classify`` is held to."""
    if not content.strip():
        return "tool_call" if tool_args.strip() else None
    if len(tool_args) > len(content):
        return "tool_call"
    if "```" in content:
        return "code"
    lines = [line for line in content.splitlines() if line.strip()]
    code = sum(map(_looks_like_code, lines))
    return "code" if lines and code / len(lines) >= 0.4 else "prose"


_PIECES = st.sampled_from(["a", " ", "\n", "\r", "\r\n", "\t", ";", "{", "}", "def ", "    x", "\x0b", "\x0c",
                           "\x1c", "\x85", "\u2028", "\u2029", "import", "`", "é", "x = 1;"])


@settings(max_examples=examples(300), deadline=None)
@given(content=st.lists(_PIECES, max_size=14).map("".join), tool_args=st.lists(_PIECES, max_size=3).map("".join))
def test_classify_reads_lines_as_splitlines_draws_them(content, tool_args):
    """The lines are found one at a time (a huge answer is not copied line by line at once), by every
    boundary ``str.splitlines`` knows."""
    assert classify(content, tool_args) == _classify_by_splitlines(content, tool_args)
