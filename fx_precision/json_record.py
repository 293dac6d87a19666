"""A dataclass that reads and writes itself as JSON by its own field types: one statement of its fields.

    JsonRecord
    ├── to_dict()                 the fields as JSON values (nested records, tuples as lists)
    └── from_dict(data, where)    the fields read back, each checked against its type hint; an unknown, a
                                  missing or a mistyped field is one PrecisionError naming it (``where.field``)

Used by the contract's evidence (contract/evidence.py) and the engine's description (engines/description.py).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

from fx_precision.errors import PrecisionError

R = TypeVar("R", bound="JsonRecord")


class JsonRecord:
    """JSON in and out by the dataclass's own field types (str, int, float, bool, None, dict[str, X], tuple[X, ...],
    list[X] and nested records), so every record class states its fields once."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[R], data: object, where: str) -> R:
        if not isinstance(data, dict):
            raise PrecisionError(f"{where}: a JSON object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise PrecisionError(f"{where}: unknown {', '.join(unknown)} (written by another fx_precision version? roll out again)")
        values = {name: _from_json(hints[name], data[name], f"{where}.{name}") for name in names if name in data}
        try:
            return cls(**values)
        except TypeError as exc:  # a field without a default missing
            raise PrecisionError(f"{where}: {exc}") from None


def _to_json(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _from_json(kind: Any, value: Any, where: str) -> Any:
    """``value`` read as ``kind`` (a resolved type hint), or one error naming ``where``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(inner, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise PrecisionError(f"{where}: a JSON object, got {type(value).__name__}")
        return {str(k): _from_json(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise PrecisionError(f"{where}: a JSON list, got {type(value).__name__}")
        items = [_from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if kind is Any:
        return value
    if isinstance(kind, type) and issubclass(kind, JsonRecord):
        return kind.from_dict(value, where)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PrecisionError(f"{where}={value!r}: a {kind.__name__}"[:300])
    return value
