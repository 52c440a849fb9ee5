"""specproxy's one exception tree.

Every error a user can cause (a bad flag, a tokenizer that will not load, a database that cannot be
opened) is a ``SpecproxyError``; the CLI prints its message as one line and exits with status 2.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "SpecproxyError", "StoreError", "TokenizerError", "UpstreamError"]


class SpecproxyError(Exception):
    """Base of every error that is the user's to fix; its message is one actionable line."""


class ConfigError(SpecproxyError):
    """A configuration value (file, environment or flag) is missing or malformed."""


class TokenizerError(SpecproxyError):
    """The tokenizer named by ``--tokenizer`` cannot be loaded."""


class StoreError(SpecproxyError):
    """The SQLite database cannot be opened, created or migrated."""


class UpstreamError(SpecproxyError):
    """The upstream inference server is unreachable or is not what it should be. ``timeout``: a deadline
    passed (the client gets 504), else a failure (502). Messages are our own words, never request
    content."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
