"""Field docstrings of a dataclass, read from its source.

Why: a docstring under each field is the definition of that field (mitmproxy's habit), and the
generated docs (``docs/schema.md``, ``config.example.toml``) come from those same strings, so the docs
cannot drift from the code. Dataclasses keep no field docs at runtime, so they are read with ``ast``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["field_docs"]


def field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
