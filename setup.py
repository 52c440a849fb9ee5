"""Only the C accelerators live here; everything else about the package is in pyproject.toml.

``specproxy.wire._relayc`` (the relay thread and the relay's per-read path),
``specproxy.frames._scanc`` (the measuring's per-chunk scans), ``specproxy.store._columnsc`` (SQLite rows into column
buffers, for the columnar cache), ``specproxy.analyze._orderc`` (the summaries' order statistics) and
``specproxy.analyze._cellsc`` (a report table's cells in one pass per column) are optional:
without a C compiler the install still succeeds and the pure-Python paths run (``specproxy serve`` logs which).
CI requires all five (``SPECPROXY_REQUIRE_RELAYC=1`` makes tests/unit/test_relayc.py, test_scanc.py,
test_columnsc.py, test_orderc.py and test_cellsc.py fail when one is missing).
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(ext_modules=[
    # The relay includes the framing headers it shares with the scans (specproxy/frames/).
    Extension("specproxy.wire._relayc",
              ["specproxy/wire/_relayc.c", "specproxy/wire/_pump.c", "specproxy/wire/_pump_wait.c",
               "specproxy/wire/_pump_py.c"],
              depends=["specproxy/frames/_hex.h", "specproxy/frames/_chunked.h", "specproxy/wire/_pump.h",
                       "specproxy/wire/_cadence.h"],
              include_dirs=["specproxy/frames"], optional=True, extra_compile_args=_FLAGS),
    # The column reader links the system's SQLite (Debian's libsqlite3-dev, which Python's sqlite3 is built on).
    Extension("specproxy.store._columnsc", ["specproxy/store/_columnsc.c"], libraries=["sqlite3"],
              optional=True, extra_compile_args=_FLAGS),
    Extension("specproxy.frames._scanc", ["specproxy/frames/_scanc.c"], depends=["specproxy/frames/_hex.h"],
              optional=True, extra_compile_args=_FLAGS),
    Extension("specproxy.analyze._orderc", ["specproxy/analyze/_orderc.c"], optional=True, extra_compile_args=_FLAGS),
    # -O3: its passes' loops unrolled and vectorised (cell counts a third quicker than at -O2)
    Extension("specproxy.analyze._cellsc", ["specproxy/analyze/_cellsc.c"], optional=True,
              extra_compile_args=[*_FLAGS, "-O3"]),
])
