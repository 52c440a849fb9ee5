"""Only the C accelerators live here; everything else about the package is in pyproject.toml.

``specproxy._relayc`` (the relay thread and the relay's per-read path) and ``specproxy._scanc`` (the
measuring's per-chunk scans) are optional: without a C compiler the install still succeeds and the
pure-Python paths run (``specproxy serve`` logs which). CI requires both (``SPECPROXY_REQUIRE_RELAYC=1`` makes
tests/test_relayc.py and tests/test_scanc.py fail when one is missing).
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(ext_modules=[
    Extension("specproxy._relayc", ["specproxy/_relayc.c", "specproxy/_pump.c", "specproxy/_pump_py.c"],
              depends=["specproxy/_hex.h", "specproxy/_chunked.h", "specproxy/_pump.h", "specproxy/_cadence.h"],
              optional=True, extra_compile_args=_FLAGS),
    Extension("specproxy._scanc", ["specproxy/_scanc.c"], depends=["specproxy/_hex.h"], optional=True,
              extra_compile_args=_FLAGS),
])
