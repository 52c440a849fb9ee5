"""The price table: what a model's tokens cost, in USD per million, as the user gives them.

Why apart from ``config/``: ``serve --config`` reads it as a key of the config file, ``report`` and
``audit`` as ``--prices FILE``; both parse it here, once. Nothing here prices a turn: that rule is
``analyze/cost.py``'s. There are no default prices: specproxy makes none up.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specproxy.errors import ConfigError

__all__ = ["PRICE_KEYS", "Price", "load_prices", "parse_prices"]


@dataclass(frozen=True, slots=True)
class Price:
    """One model's prices, in USD per million tokens, as the price table gives them (``parse_prices``).
    A price left out of the table is the one it would otherwise be: ``cached_input`` and ``cache_write``
    default to ``input``, ``reasoning`` to ``output``; so a turn needs a count (cached, reasoning) only
    where the table prices it apart (``analyze/cost.py`` decides a turn's cost)."""

    input: float
    output: float
    cached_input: float
    cache_write: float
    reasoning: float


PRICE_KEYS = ("input", "cached_input", "cache_write", "output", "reasoning")


def parse_prices(data: Any, source: str) -> dict[str, Price]:
    """The price table ``data`` (model -> {price name: USD per million tokens}) as Prices; a table that
    is not one is a ConfigError naming ``source`` and what is wrong, in one line."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: prices must be a table of models, e.g. [prices.\"my-model\"] with "
                          "input = 0.5 and output = 2.0 (USD per million tokens)")
    table: dict[str, Price] = {}
    for model, given in data.items():
        if not isinstance(given, dict):
            raise ConfigError(f"{source}: prices.{model!r} must be a table of prices (input, output...)")
        unknown = sorted(set(given) - set(PRICE_KEYS))
        if unknown:
            raise ConfigError(f"{source}: prices.{model!r}: unknown price {unknown[0]!r} (known: {', '.join(PRICE_KEYS)})")
        for name in ("input", "output"):
            if name not in given:
                raise ConfigError(f"{source}: prices.{model!r} needs {name} (USD per million tokens)")
        values = {}
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"{source}: prices.{model!r}.{name} must be a number of USD per million "
                                  f"tokens, at least 0; got {value!r}")
            values[name] = float(value)
        table[str(model)] = Price(input=values["input"], output=values["output"],
                                  cached_input=values.get("cached_input", values["input"]),
                                  cache_write=values.get("cache_write", values["input"]),
                                  reasoning=values.get("reasoning", values["output"]))
    return table


def load_prices(path: str | os.PathLike) -> dict[str, Price]:
    """The ``prices`` table of a TOML file (``report --prices FILE``: a serve config file will do, its other
    keys are not read)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"prices file not found: {p}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prices file {p} is not valid TOML: {exc}") from None
    if "prices" not in data:
        raise ConfigError(f"prices file {p} has no prices table: add [prices.\"MODEL\"] with input and output "
                          "(USD per million tokens)")
    return parse_prices(data["prices"], str(p))
