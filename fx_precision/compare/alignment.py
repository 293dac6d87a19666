"""Calls aligned across the sides by (FQN, call): side b's module names renamed by an FQN map (``"self_attn=attn;
model.layers.*=layers.*"``, globs), a map that matches nothing or sends two modules to one refused."""

from __future__ import annotations

import re
from dataclasses import replace

from fx_precision.dump import Dump
from fx_precision.errors import PrecisionError


def parse_fqn_map(text: str | dict[str, str] | None) -> list[tuple[str, str]]:
    """``"self_attn=attn; model.layers.*=layers.*"`` -> [(a pattern, b pattern)]."""
    if not text:
        return []
    if isinstance(text, dict):
        for a, b in text.items():
            if not isinstance(a, str) or not isinstance(b, str) or not a.strip() or not b.strip():
                raise PrecisionError(f"FQN map entry {a!r}: {b!r}: both sides need a name (non-empty strings)")
        return list(text.items())
    if not isinstance(text, str):
        raise PrecisionError(f"fqn_map={text!r}: a text 'a_name=b_name; ...' or a dict {{a_name: b_name}}")
    pairs = []
    for part in re.split(r"[;,]", text):
        if not part.strip():
            continue
        if part.count("=") != 1:
            raise PrecisionError(f"FQN map entry {part.strip()!r}: expected A_NAME=B_NAME (a segment or a glob, e.g. self_attn=attn)")
        a, b = (s.strip() for s in part.split("="))
        if not a or not b:
            raise PrecisionError(f"FQN map entry {part.strip()!r}: both sides need a name")
        pairs.append((a, b))
    return pairs


def _pattern(glob: str) -> re.Pattern[str]:
    body = re.escape(glob).replace(r"\*", r"([^.]+)")
    return re.compile(rf"(^|.+\.){body}(\..+|$)")


def rename(fqn: str, mapping: list[tuple[str, str]]) -> str:
    """Side b's FQN in side a's names: each (a, b) rewrites the segments matching b into a."""
    for a, b in mapping:
        match = _pattern(b).match(fqn)
        if match:
            captured = iter(match.groups()[1:-1])
            a_text = "".join(next(captured, "*") if piece == "*" else piece for piece in re.split(r"(\*)", a))
            fqn = f"{match.group(1)}{a_text}{match.groups()[-1]}"
    return fqn


def renamed_side(db: Dump, fqn_map: str | dict[str, str] | None) -> Dump:
    """Side b with its modules renamed by ``fqn_map`` (a copy: the caller's Dump keeps its own names); refused when a
    pattern matches no module of side b, or two modules are sent to one name."""
    mapping = parse_fqn_map(fqn_map)
    if not mapping:
        return db
    names_b = {r.fqn for r in db.records}
    for pa, pb in mapping:
        if not any(_pattern(pb).match(n) for n in names_b):
            raise PrecisionError(f"FQN map {pa}={pb}: {pb!r} matches no module of side b ({db.source}); check the names")
    renamed: dict[str, str] = {}
    for name in sorted(names_b):
        new = rename(name, mapping)
        if new in renamed and renamed[new] != name:
            raise PrecisionError(
                f"FQN map {fqn_map!r} sends side b's {renamed[new]!r} and {name!r} both to {new!r}; a map must keep modules "
                "apart: make the patterns more specific"
            )
        renamed[new] = name
    return replace(
        db,
        records=[replace(r, fqn=rename(r.fqn, mapping)) for r in db.records],
        calls=[replace(c, fqn=rename(c.fqn, mapping)) for c in db.calls],
        replays={(rename(f, mapping), c): v for (f, c), v in db.replays.items()},
    )
