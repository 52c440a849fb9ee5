"""Whose turn it is: the tenant, from a header the operator names or from the API key, never keeping the key.

Why a keyed hash of the key: operators want spend per team or customer, and the API key is often the
only thing that tells them apart. The key itself must never reach the database or a log, and a plain
hash of it would let anyone holding the database test guessed keys against it offline, or match one
database's tenants against another's. An HMAC-SHA256 under a secret drawn at random for each database
(kept in its ``store_meta`` table) names the same key the same way in that database only. Computed in
the measuring thread (``build._record_of``), off the forwarding path.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from specproxy.measure.session import client_of

__all__ = ["KEY_HEADERS", "KEY_PREFIX", "TenantRule", "key_fingerprint"]

# where the SDKs put the key: OpenAI's (Authorization: Bearer), Anthropic's (x-api-key), Azure's (api-key)
KEY_HEADERS = (b"authorization", b"x-api-key", b"api-key")
KEY_PREFIX = "key:"
FINGERPRINT_HEX = 16  # 64 bits: tenants of one database never collide in practice, and no key is recoverable


def key_fingerprint(secret: bytes, key: bytes) -> str:
    """``key:`` and 16 hex digits of HMAC-SHA256(``secret``, ``key``)."""
    return KEY_PREFIX + hmac.new(secret, key, hashlib.sha256).hexdigest()[:FINGERPRINT_HEX]


def _api_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The request's API key: the credential of ``Authorization`` (after its scheme, ``Bearer``), else the
    value of ``x-api-key`` or ``api-key``; None when it sends none."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        low = name.lower()
        if low in KEY_HEADERS and low not in found:
            found[low] = value.strip()
    for name in KEY_HEADERS:
        value = found.get(name)
        if not value:
            continue
        if name == b"authorization":
            scheme, _, credential = value.partition(b" ")
            value = credential.strip() if credential.strip() else scheme
        if value:
            return value
    return None


class TenantRule:
    """How this proxy names a turn's tenant: by ``header``'s value (lower-case bytes), or by the API key's
    fingerprint under ``secret``. At most one is given (Config refuses both)."""

    __slots__ = ("header", "secret")

    def __init__(self, *, header: str | None = None, secret: bytes | None = None) -> None:
        self.header = header.strip().lower().encode() if header else None
        self.secret = secret

    def of(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """The tenant of a request with these raw headers, or None."""
        if self.header is not None:
            return client_of(headers, self.header)
        if self.secret is not None:
            key = _api_key(headers)
            return key_fingerprint(self.secret, key) if key is not None else None
        return None
