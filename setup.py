"""Only the C accelerator lives here; everything else about the package is in pyproject.toml.

``specproxy._relayc`` is optional: without a C compiler the install still succeeds and the relay runs
its pure-Python path (``specproxy serve`` logs which one it uses). CI requires it
(``SPECPROXY_REQUIRE_RELAYC=1`` makes tests/test_relayc.py fail when it is missing).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("specproxy._relayc", ["specproxy/_relayc.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers"])])
