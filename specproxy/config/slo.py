"""A service-level objective as the user writes it (``ttft=2s,tpot=50ms; batch: e2e=60s``), parsed.

Why apart from the rule that judges turns by it (``measure/slo_rule.py``): the config only needs to know
the objective is well formed, at start-up; judging a turn is measuring's and analysis's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specproxy.errors import ConfigError

__all__ = ["SLO_FIGURES", "Slo", "parse_slo"]

@dataclass(frozen=True, slots=True)
class Slo:
    """A service-level objective: upper bounds in seconds on a turn's TTFT, its time per output token
    after the first chunk (``tpot``) and its whole time (``e2e``); None where the objective sets none.
    ``labels``: the objectives of labels that have their own (``chat: ttft=1s``), which their turns are
    judged by instead. ``text`` is how the user wrote it, said back in every report."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    labels: tuple[tuple[str, Slo], ...] = ()

    @property
    def bounded(self) -> bool:
        """Whether this objective sets any bound (one given per label only sets none for the rest)."""
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def for_label(self, label: str | None) -> Slo | None:
        """The objective a turn with ``label`` is judged by: its label's own, else this one's bounds;
        None when neither sets any (the turn is not judged)."""
        for name, own in self.labels:
            if name == label:
                return own
        return self if self.bounded else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "text": self.text}
        if self.labels:
            out["by_label"] = {name: own.as_dict() for name, own in self.labels}
        return out


SLO_FIGURES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
_SLO_UNITS = (("ms", 1e-3), ("s", 1.0))  # "ms" first: "50ms" also ends in "s"


def _slo_bounds(group: str, text: str, what: str) -> Slo:
    """One objective, ``ttft=2s,tpot=50ms,e2e=30s`` (any subset, each once, a unit on every value)."""
    bounds: dict[str, float] = {}
    for part in group.split(","):
        name, eq, value = (p.strip() for p in part.partition("="))
        if not eq or name not in SLO_FIGURES:
            raise ConfigError(f"{what} {text!r}: {part.strip()!r} is not NAME=VALUE with NAME one of "
                              f"{', '.join(SLO_FIGURES)} (e.g. ttft=2s,tpot=50ms,e2e=30s)")
        if SLO_FIGURES[name] in bounds:
            raise ConfigError(f"{what} {text!r}: {name} is given twice")
        unit = next(((u, k) for u, k in _SLO_UNITS if value.endswith(u)), None)
        try:
            number = float(value[: -len(unit[0])]) if unit else None
        except ValueError:
            number = None
        if unit is None or number is None or not number > 0 or number == float("inf"):
            raise ConfigError(f"{what} {text!r}: {name}={value!r} is not a positive time with a unit "
                              "(ms or s, e.g. 50ms or 2s)")
        bounds[SLO_FIGURES[name]] = number * unit[1]
    return Slo(**bounds, text=",".join(p.strip() for p in group.split(",")))


def parse_slo(text: str | None, what: str = "--slo") -> Slo | None:
    """``ttft=2s,tpot=50ms,e2e=30s`` (any subset) as an ``Slo``, for every turn; with objectives of
    their own for labels after it, separated by ``;``: ``ttft=2s,tpot=50ms; batch: e2e=60s`` (turns
    labelled ``batch`` are judged by ``e2e=60s`` alone). Without a group for every turn, only the named
    labels' turns are judged. None for None or an empty text; anything else is a ConfigError of one
    line saying what is wrong."""
    if text is None or not text.strip():
        return None
    default: Slo | None = None
    labels: dict[str, Slo] = {}
    for group in (g.strip() for g in text.split(";")):
        head, colon, rest = group.partition(":")
        if not group:
            raise ConfigError(f"{what} {text!r}: an empty objective between ';' (e.g. ttft=2s; batch: e2e=60s)")
        if colon and "=" not in head:
            label = head.strip()
            if not label or not rest.strip():
                raise ConfigError(f"{what} {text!r}: {group!r} is not LABEL: NAME=VALUE,... (e.g. batch: e2e=60s)")
            if label in labels:
                raise ConfigError(f"{what} {text!r}: label {label!r} is given twice")
            labels[label] = _slo_bounds(rest.strip(), text, what)
        elif default is not None:
            raise ConfigError(f"{what} {text!r}: two objectives for every turn; name a label for the "
                              "second (LABEL: NAME=VALUE,...)")
        else:
            default = _slo_bounds(group, text, what)
    groups = ([default.text] if default else []) + [f"{name}: {own.text}" for name, own in labels.items()]
    base = default or Slo()
    return Slo(base.ttft_s, base.tpot_s, base.e2e_s, text="; ".join(groups), labels=tuple(labels.items()))
