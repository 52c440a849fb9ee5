"""Which kind of output a turn delivered: code, prose or a tool call.

Why: speculative decoding accepts far more of predictable output (code) than of prose (docs/performance.md,
"Design figures"), so a speedup measured on one class does not transfer to the
other, and every report cell should say which class it is. The rule is simple and deterministic, run
once per turn in the measuring thread on text that is in memory anyway (never stored unless opted in):

* ``tool_call`` when tool-call arguments are most of the output;
* ``code`` when the content has a fenced block, or at least 40% of its non-empty lines look like code
  (indented, ending in ``;``, ``{`` or ``}``, or starting with a common keyword);
* ``prose`` otherwise.
"""

from __future__ import annotations

import re

__all__ = ["classify"]

# a line that looks like code: indented, or beginning with a common keyword (both anchored at the line's
# start, so a long line of prose is not scanned at every position), or ending in ";", "{" or "}"
_CODE_START = re.compile(
    r"(?:\s{4,}\S|\t\S)|\s*(?:def|class|import|from|return|if|elif|else|for|while|try|except|"
    r"#include|function|const|let|var|fn|pub|func|package|SELECT|public|private|static)\b"
)
_CODE_END = (";", "{", "}")
# the runs between line boundaries, as str.splitlines draws them, found one at a time: a huge answer's
# lines are not all copied at once (one large turn is held about once: docs/operations.md, "Memory")
_LINE = re.compile("[^\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]+")


def classify(content: str, tool_args: str = "") -> str | None:
    """The class of one turn's delivered output; None when nothing was delivered."""
    if not content or content.isspace():
        return "tool_call" if tool_args and not tool_args.isspace() else None
    if len(tool_args) > len(content):
        return "tool_call"
    if "```" in content:
        return "code"
    lines = code = 0
    for m in _LINE.finditer(content):  # read in place: not even one line is copied
        start, end = m.span()
        last = end - 1
        while last >= start and content[last].isspace():
            last -= 1
        if last >= start:  # not a blank line
            lines += 1
            code += content[last] in _CODE_END or _CODE_START.match(content, start, end) is not None
    return "code" if lines and code / lines >= 0.4 else "prose"


def _looks_like_code(line: str) -> bool:
    """For a line that is not blank."""
    return line.rstrip()[-1] in _CODE_END or _CODE_START.match(line) is not None
