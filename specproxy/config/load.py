"""Where each setting comes from: a TOML file, then ``SPECPROXY_*`` environment variables, then CLI flags.

Why here and nowhere else: this is the one module that reads the environment (``child_environment``
hands it on), so a setting cannot be read from two places that disagree.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Mapping

from specproxy.config.checks import validate
from specproxy.config.settings import Config
from specproxy.errors import ConfigError
from specproxy.prices import Price, parse_prices

__all__ = ["KEYS", "REMOVED", "child_environment", "load_config"]

KEYS: dict[str, type] = {}
for _f in fields(Config):
    _t = str(_f.type)
    KEYS[_f.name] = bool if "bool" in _t else int if _t == "int" else float if _t == "float" else str
# settings that are gone, and what to do where a file or the environment still names one
REMOVED = {"scan": "the measuring reads streams with its C scans wherever they are built (the reference "
                   "where not); delete it"}


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = KEYS[key]
    if value is None:
        return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be {kind.__name__}, got {value!r}") from None



def _prices_value(table: dict[str, Price]) -> tuple[tuple[str, Price], ...]:
    return tuple(sorted(table.items()))



def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment for a command specproxy runs for the user (``bench --restart-cmd``): this process's
    own, so the command finds what the user's shell would give it, plus ``extra``. Here because this module
    is the one place that reads the environment."""
    return {**os.environ, **extra}


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """File, then environment (``SPECPROXY_PORT=9000``...), then flags (``None`` means not given)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        for key, value in data.items():
            if key in REMOVED:
                raise ConfigError(f"config file {p}: {key!r} was removed: {REMOVED[key]}")
            if key not in KEYS:
                raise ConfigError(f"config file {p}: unknown key {key!r} (see config.example.toml)")
            if key == "prices":
                values[key] = _prices_value(parse_prices(value, str(p)))
                continue
            values[key] = _coerce(key, value, str(p))
    env = os.environ if env is None else env
    for key, why in REMOVED.items():
        if f"SPECPROXY_{key.upper()}" in env:
            raise ConfigError(f"SPECPROXY_{key.upper()} was removed: {why}")
    for key in KEYS:
        name = f"SPECPROXY_{key.upper()}"
        if name in env and key == "prices":
            try:
                inline = tomllib.loads(f"prices = {env[name]}")["prices"]
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{name} is not a TOML inline table of prices: {exc}") from None
            values[key] = _prices_value(parse_prices(inline, name))
        elif name in env:
            values[key] = _coerce(key, env[name], name)
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in KEYS:
                raise ConfigError(f"unknown setting {key!r}")
            if key == "prices":
                values[key] = _prices_value(value if isinstance(value, dict) else dict(value))
                continue
            values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    return validate(replace(Config(), **_with_tenant_secret(values)))


def _with_tenant_secret(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``tenant_secret`` read from ``tenant_secret_file`` when that names one, stripped of
    surrounding whitespace either way (a file's final newline; the same text in a file and in the
    environment must key the same fingerprints, or a fleet mixing the two splits its tenants again).

    Why read here, once: a missing or unreadable file is said at start-up in one line, and the secret
    then lives only in the frozen ``Config`` (``repr`` leaves it out), never in the database. No message
    quotes the secret."""
    path = values.get("tenant_secret_file")
    if path is not None:
        if values.get("tenant_secret") is not None:
            raise ConfigError("tenant_secret_file and tenant_secret (SPECPROXY_TENANT_SECRET) both give the "
                              "shared tenant secret: choose one")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read tenant_secret_file {path}: {exc.strerror or type(exc).__name__}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"tenant_secret_file {path} is not UTF-8 text") from None
        if not text.strip():
            raise ConfigError(f"tenant_secret_file {path} is empty: put the shared secret in it "
                              "(e.g. openssl rand -hex 32 > FILE)")
        values = {**values, "tenant_secret": text}
    if values.get("tenant_secret") is not None:
        values = {**values, "tenant_secret": values["tenant_secret"].strip()}
    return values
