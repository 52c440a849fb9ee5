"""Generate the docs that come from code: config.example.toml and docs/schema.md.

    python scripts/gen_docs.py          # rewrite them
    python scripts/gen_docs.py --check  # exit 1 when they are stale (the test suite runs this)
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

from specproxy.config import Config
from specproxy.fielddocs import field_docs
from specproxy.record import FIELD_DOCS, Record

ROOT = Path(__file__).resolve().parent.parent


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def config_example() -> str:
    docs = field_docs(Config)
    out = ["# specproxy configuration. Precedence: this file < SPECPROXY_* environment < command-line flags.",
           "# Generated from specproxy/config.py by scripts/gen_docs.py; every key is shown with its default.", ""]
    for f in fields(Config):
        for line in textwrap.wrap(docs.get(f.name, ""), 98):
            out.append(f"# {line}")
        default = f.default if f.default is not MISSING else None
        env = f"SPECPROXY_{f.name.upper()}"
        out.append(f"# environment: {env}")
        if default is None:
            example = {"upstream": "http://127.0.0.1:8000", "label": "config-a",
                       "admin_token": "a-long-random-secret"}.get(f.name, "hf:/path/to/tokenizer-dir")
            out.append(f"# {f.name} = {_toml_value(example)}")
        else:
            out.append(f"{f.name} = {_toml_value(default)}")
        out.append("")
    return "\n".join(out)


def schema_md() -> str:
    out = ["# The `turns` table and `specproxy export` fields", "",
           "Generated from `specproxy/record.py` by `scripts/gen_docs.py`. Names and meanings follow [metrics.md](metrics.md).",
           "", "| field | type | meaning |", "| --- | --- | --- |"]
    for f in fields(Record):
        doc = FIELD_DOCS.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{f.name}` | `{f.type}` | {doc} |")
    out += ["", "## The `captures` table", "",
            "Only with `serve --capture` (opt-in): each measured request's body as the client sent it, for "
            "`specproxy export --format replay` and `specproxy bench --from captured` ([bench.md](bench.md)). "
            "Headers are never stored, so neither are API keys. `specproxy prune --turns` deletes a turn's "
            "capture with it.", "",
            "| field | type | meaning |", "| --- | --- | --- |",
            "| `turn_id` | `str` | the turn's `id` |",
            "| `t_wall` | `float` | the turn's `t_wall` |",
            "| `method`, `path` | `str` | as the client sent them |",
            "| `content_encoding` | `str` | the request's Content-Encoding (empty when none); `body` is in it |",
            "| `body` | `bytes` | the request body, byte for byte |"]
    return "\n".join(out) + "\n"


TARGETS = {ROOT / "config.example.toml": config_example, ROOT / "docs" / "schema.md": schema_md}


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for path, make in TARGETS.items():
        text = make()
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale generated docs (run python scripts/gen_docs.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
