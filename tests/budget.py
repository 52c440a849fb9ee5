"""How many examples the property tests draw: the number each test names, times ``SPECPROXY_TEST_EXAMPLES``
(default 1). The default keeps the suite's run short; a deeper pass before a release, or after a change
to the native parsers and scans, runs the same tests with e.g. ``SPECPROXY_TEST_EXAMPLES=5``."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("SPECPROXY_TEST_EXAMPLES", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))
