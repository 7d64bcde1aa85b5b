"""What every config dataclass shares (TrainConfig, DemoConfig, PretrainConfig, the CLI's EvalConfig and DataConfig):
the docstring under each field, building one from a JSON object, reading a JSON file of fields.

    field_docs(TrainConfig)["lr"]                     # the text under the field: CLI help, widget tooltips
    from_dict(TrainConfig, {"lr": 1e-5})              # unknown fields refused by name; nested configs from objects
    read_json("my_run.json")                          # ConfigError naming the file and line if it is not an object

No torch, no I/O beyond the one file read: the CLI builds its options from these before anything heavy loads.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import types
import typing
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "field_docs", "from_dict", "nested_config", "read_json"]


class ConfigError(ValueError):
    """A config that cannot be built as given: an unknown field, a file that is not a JSON object of fields."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass, read from its source (the fields of its bases too).

    A field declared elsewhere and only carried here, ``ar_alpha: float | None = Method.ar_alpha`` (a default that is
    another dataclass's field of the same name), has that field's docstring: one declaration, one text."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a frozen app): no help text, nothing else lost
            continue
        body = tree.body[0].body
        for node, nxt in itertools.pairwise([*body, None]):
            if not isinstance(node, ast.AnnAssign):
                continue
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
            elif (source := _declared_in(klass, node)) is not None:
                docs[node.target.id] = field_docs(source).get(node.target.id, "")
    return docs


def _declared_in(klass: type, node: ast.AnnAssign) -> type | None:
    """The dataclass a field's default names as ``Other.<the same field>``, if it does."""
    value = node.value
    if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.attr == node.target.id):
        return None
    source = vars(inspect.getmodule(klass)).get(value.value.id)
    return source if dataclasses.is_dataclass(source) else None


def nested_config(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` when it holds a nested config (``X`` or ``X | None``)."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    nested = [a for a in args if dataclasses.is_dataclass(a)]
    return nested[0] if nested else None


def from_dict(cls: type, values: Mapping, owner: str | None = None) -> Any:
    """``cls(**values)`` with every key checked first: an unknown one is a ConfigError naming it (and the fields
    that exist). The config validates itself (a nested config given as an object is read by its owner: a
    DemoConfig's ``train`` as changes to the demo's settings, a PretrainConfig's ``spec`` as a LabModelSpec)."""
    owner = owner or cls.__name__
    if not isinstance(values, Mapping):
        raise ConfigError(f"{owner}: expected an object of fields, got a {type(values).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        close = sorted({m for name in unknown for m in difflib.get_close_matches(str(name), known, n=2)})
        hint = f"; did you mean {close}?" if close else f"; the fields are {known}" if len(known) <= 12 else ""
        raise ConfigError(f"{owner}: unknown field(s) {unknown}{hint}")
    return cls(**values)


def read_json(file: str | Path) -> dict:
    """A JSON file holding one object (of config fields): the object, or a ConfigError naming the file and line."""
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} line {err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a JSON {type(values).__name__}, not an object of fields")
    return values
