"""Content classes: code, prose and tool calls are told apart, deterministically."""

from __future__ import annotations

import pytest

from specproxy.content import classify


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
