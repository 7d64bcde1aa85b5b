"""Field checks for the config dataclasses: every failure is a ValueError that names ``Class.field``.

    check = FieldCheck(config)                 # owner name from the class: "TrainConfig"
    check.real("lr", low=0, low_open=True)     # ValueError: TrainConfig.lr must be a finite number > 0, got 'fast'
    check.integer("group_size", low=2)
    check.need(batch % minibatch == 0, "minibatch_size", "must divide the batch B = 64")

Types are checked before ranges, so a string where a number belongs is refused by name instead of surfacing later as
a TypeError from a comparison; bools are not accepted as numbers (JSON's ``true`` is not a step count), numbers must
be finite. No torch, no I/O: the configs run these checks in ``__post_init__``, before anything loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bounds(low, high, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return " and ".join(parts)


def _in_range(value, low, high, low_open: bool, high_open: bool) -> bool:
    if low is not None and (value <= low if low_open else value < low):
        return False
    return not (high is not None and (value >= high if high_open else value > high))


class FieldCheck:
    """Checks the fields of one config object; ``owner`` prefixes every message (default: the class name)."""

    def __init__(self, obj: Any, owner: str | None = None):
        self.obj, self.owner = obj, owner or type(obj).__name__

    def fail(self, name: str, what: str) -> None:
        raise ValueError(f"{self.owner}.{name} {what}, got {getattr(self.obj, name)!r}")

    def need(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            self.fail(name, what)

    def _optional(self, name: str, optional: bool) -> tuple[Any, bool]:
        value = getattr(self.obj, name)
        return value, optional and value is None

    def integer(self, name: str, low: int | None = None, high: int | None = None, optional: bool = False) -> None:
        value, skip = self._optional(name, optional)
        if skip:
            return
        closed = {"low_open": False, "high_open": False}
        what = "must be an int" + (f" {_bounds(low, high, **closed)}" if low is not None or high else "")
        self.need(is_int(value) and _in_range(value, low, high, **closed), name, what + _or_none(optional))

    def real(
        self,
        name: str,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        high_open: bool = False,
        optional: bool = False,
    ) -> None:
        value, skip = self._optional(name, optional)
        if skip:
            return
        bounds = _bounds(low, high, low_open, high_open)
        what = "must be a finite number" + (f" {bounds}" if bounds else "") + _or_none(optional)
        self.need(is_real(value) and _in_range(value, low, high, low_open, high_open), name, what)

    def flag(self, name: str) -> None:
        self.need(isinstance(getattr(self.obj, name), bool), name, "must be True or False")

    def text(self, name: str, optional: bool = False) -> None:
        value, skip = self._optional(name, optional)
        if not skip:
            self.need(isinstance(value, str) and value != "", name, "must be a non-empty string" + _or_none(optional))

    def choice(self, name: str, options: Iterable[str]) -> None:
        options = tuple(options)
        value = getattr(self.obj, name)
        self.need(isinstance(value, str) and value in options, name, f"must be one of {options}")

    def items(
        self, name: str, test: Callable[[Any], bool], what: str, *, nonempty: bool = True, distinct: bool = False
    ) -> None:
        """A tuple (lists are accepted by the configs and turned into tuples) whose every item passes ``test``."""
        value = getattr(self.obj, name)
        ok = isinstance(value, tuple) and all(test(v) for v in value)
        self.need(ok, name, f"must be a list of {what}")
        self.need(not nonempty or len(value) > 0, name, "must not be empty")
        self.need(not distinct or len(set(value)) == len(value), name, "must not repeat an item")


def _or_none(optional: bool) -> str:
    return " or None" if optional else ""


def rename_owner(err: ValueError, inner: str, outer: str, fields: Iterable[str]) -> ValueError:
    """An error about ``inner.field`` restated about ``outer.field`` when ``outer`` has that field (a DemoConfig
    builds a TrainConfig from its own fields: a bad minibatch is the DemoConfig's field, not the TrainConfig's).

    >>> str(rename_owner(ValueError("TrainConfig.lr must be > 0, got 0"), "TrainConfig", "DemoConfig", ["lr"]))
    'DemoConfig.lr must be > 0, got 0'
    """
    text, fields = str(err), set(fields)
    name = text.removeprefix(f"{inner}.").split(" ")[0].split(":")[0]
    if text.startswith(f"{inner}.") and name in fields:
        return ValueError(f"{outer}.{name}" + text.removeprefix(f"{inner}.{name}"))
    return ValueError(f"{outer}: {text}")
