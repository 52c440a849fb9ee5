"""``Record``'s constructor: the slot-setting ``__init__`` (record.py) behaves as the dataclass's own."""

from __future__ import annotations

import dataclasses
import random

import pytest

from specproxy.record import FIELD_NAMES, Record, _slot_setting_init

REQUIRED = {"id": "ab" * 16, "t_wall": 1.5, "method": "POST", "path": "/v1/chat/completions", "status": 200,
            "outcome": "ok"}


def _pair():
    """The same frozen, slotted, keyword-only class twice: with the dataclass's ``__init__`` and with ours."""
    def make():
        @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
        class Row:
            a: int
            b: str
            c: float | None = None
            d: tuple = ()
            e: bool = False
        return Row
    theirs, ours = make(), make()
    _slot_setting_init(ours)
    return theirs, ours


def _outcome(cls, args, kwargs):
    try:
        row = cls(*args, **kwargs)
    except TypeError:
        return "TypeError"
    return {f.name: getattr(row, f.name) for f in dataclasses.fields(cls)}


def test_the_slot_setting_init_does_what_the_dataclass_init_does():
    theirs, ours = _pair()
    rng = random.Random(5)
    values = {"a": 1, "b": "x", "c": 2.5, "d": (1,), "e": True, "f": 0}  # f: not a field
    for _ in range(300):
        kwargs = {k: v for k, v in values.items() if rng.random() < 0.6}
        args = (1,) if rng.random() < 0.1 else ()
        assert _outcome(ours, args, kwargs) == _outcome(theirs, args, kwargs), (args, kwargs)


def test_a_record_takes_its_fields_by_keyword_with_their_defaults_and_stays_frozen():
    r = Record(**REQUIRED, model="m", completion_tokens=7)
    defaults = {f.name: f.default for f in dataclasses.fields(Record) if f.default is not dataclasses.MISSING}
    for name in FIELD_NAMES:
        expected = {**REQUIRED, "model": "m", "completion_tokens": 7}.get(name, defaults.get(name))
        assert getattr(r, name) == expected, name
    assert r == Record(**REQUIRED, completion_tokens=7, model="m") and hash(r) == hash(Record(**r.to_dict()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Record(**{k: v for k, v in REQUIRED.items() if k != "outcome"})
    with pytest.raises(TypeError):
        Record(**REQUIRED, no_such_field=1)
    with pytest.raises(TypeError):
        Record("ab" * 16, **{k: v for k, v in REQUIRED.items() if k != "id"})
    assert dataclasses.replace(r, model="n").model == "n"  # replace() goes through __init__ too


def test_what_the_slot_setting_init_cannot_do_the_same_way_is_refused_at_import():
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class NotInInit:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class PostInit:
        a: int = 0

        def __post_init__(self) -> None:
            pass

    for cls in (Factory, NotInInit, PostInit):
        with pytest.raises(TypeError, match=cls.__name__):
            _slot_setting_init(cls)
