"""The pipeline's direction holds: ``lint-imports`` checks the contracts in pyproject.toml.

A module that imports against the layers (analysis reaching into the wire, SQL outside the store,
measuring doing I/O), or two modules that import each other (directly or through others: a circle that
makes a reader read both to understand either), fail here, in the same run as every other test.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency: pip install -e '.[test]'"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _foreign_underscores(path: Path) -> list[str]:
    """Where a module reads another object's or module's underscore names: ``x._name`` on anything but
    ``self``/``cls``, and ``from m import _name`` (a private native module of its own package aside)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.endswith("c"):
                    found.append(f"{path.name}:{node.lineno}: import {alias.name}")
    return found


def test_the_wire_and_measuring_read_no_other_modules_underscore_names():
    """The wire's modules talk through public names (the pool's checkout, check-in and discard; the relay
    interface; the Recorder protocol), so that each can change inside without the others knowing; the
    one handler that drives an exchange (serve/proxy.py) likewise; and so do measuring's readers (the
    native chat reader takes the chunk templates, the accounting rule and the C scans by public names)
    and the framing they read."""
    packages = ("wire", "measure", "frames")
    files = [p for pkg in packages for p in sorted((ROOT / "specproxy" / pkg).glob("*.py"))]
    files.append(ROOT / "specproxy" / "serve" / "proxy.py")
    found = [hit for path in files for hit in _foreign_underscores(path)]
    assert found == [], found
