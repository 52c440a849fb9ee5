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
