"""The precision spec: rules that select modules or parameters and pin their dtype axes.

    PrecisionSpec
    ├── Rule(ModuleSel(fqn="*embed_tokens"),        gather=bf16)
    ├── Rule(ModuleSel(cls="*RMSNorm"),             gather=fp32)
    └── Rule(ParamSel("*.A_log"),                   master=fp32)

A ``ModuleSel`` selects every parameter under the modules it matches; a ``ParamSel`` selects
parameters by FQN. Rules fold in order, last match wins per axis. ``DEFAULT`` on an axis
means "back to the run default" (the plan's ``default_gather`` / ``default_master``).

Rule text (``parse_precision_rules``) is the command-line form of the same thing::

    *embed_tokens=bf16; cls:*RMSNorm=gather:fp32; param:*.A_log=master:fp32
    model.layers.*&cls:*DecoderLayer=gather:bf16,master:fp32
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Union

import torch

from fx_precision.dtypes import AXIS_DTYPES, NAME_TO_DTYPE, dtype_name
from fx_precision.errors import PrecisionError, RuleSyntaxError


class _Default:
    """Sentinel dtype: the run default of that axis."""

    _instance: _Default | None = None

    def __new__(cls) -> _Default:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DEFAULT"

    def __reduce__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = _Default()
AxisDtype = Union[torch.dtype, _Default]  # noqa: UP007 - a runtime alias, py3.10 has no | on classes here


@functools.lru_cache(maxsize=1024)
def glob_matcher(pattern: str) -> Callable[[str], re.Match[str] | None]:
    """``fnmatch.fnmatchcase(text, pattern)`` as a compiled regex's ``match`` (not None: it matches)."""
    return re.compile(fnmatch.translate(pattern)).match


@dataclass(frozen=True)
class ModuleSel:
    """Modules whose FQN matches ``fqn`` and whose class name matches ``cls`` (both globs).

    The root module's FQN is ``""``. Either glob may be omitted, not both.
    """

    fqn: str | None = None
    cls: str | None = None

    def __post_init__(self) -> None:
        if self.fqn is None and self.cls is None:
            raise PrecisionError("ModuleSel needs fqn=, cls= or both (for example ModuleSel(fqn='*embed_tokens'))")

    def matches(self, fqn: str, module: torch.nn.Module) -> bool:
        return self.matcher()(fqn, module)

    def matcher(self) -> Callable[[str, torch.nn.Module], bool]:
        """``matches`` for a walk over many modules: the globs compiled once, the class test once per class."""
        by_path = glob_matcher(self.fqn) if self.fqn is not None else None
        by_class = glob_matcher(self.cls) if self.cls is not None else None
        classes: dict[type, bool] = {}

        def match(fqn: str, module: torch.nn.Module) -> bool:
            if by_path is not None and by_path(fqn) is None:
                return False
            if by_class is None:
                return True
            kind = type(module)
            if kind not in classes:
                classes[kind] = by_class(kind.__name__) is not None
            return classes[kind]

        return match

    def text(self) -> str:
        if self.fqn is not None and self.cls is not None:
            return f"{self.fqn}&cls:{self.cls}"
        if self.cls is not None:
            return f"cls:{self.cls}"
        return str(self.fqn)


@dataclass(frozen=True)
class ParamSel:
    """Parameters (never buffers) whose FQN matches the glob ``fqn``."""

    fqn: str

    def matches(self, fqn: str) -> bool:
        return glob_matcher(self.fqn)(fqn) is not None

    def text(self) -> str:
        return f"param:{self.fqn}"


Selector = Union[ModuleSel, ParamSel]  # noqa: UP007 - a runtime alias


def _axis_text(value: AxisDtype) -> str:
    return "default" if value is DEFAULT else dtype_name(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rule:
    """Pin the gather and/or master axis of what ``select`` selects.

    ``gather`` / ``master``: a float dtype, ``DEFAULT`` (the run default), or ``None`` (this rule
    leaves the axis alone). A rule must set at least one axis.
    """

    select: Selector
    gather: AxisDtype | None = None
    master: AxisDtype | None = None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.gather is None and self.master is None:
            raise PrecisionError(f"rule {self.select.text()!r} sets neither gather= nor master=; give it at least one")
        for axis, value in (("gather", self.gather), ("master", self.master)):
            if value is None or value is DEFAULT:
                continue
            if not isinstance(value, torch.dtype) or value not in AXIS_DTYPES:
                raise PrecisionError(
                    f"rule {self.select.text()!r}: {axis}={value!r} is not a precision dtype; "
                    f"use one of {', '.join(NAME_TO_DTYPE)} or DEFAULT"
                )

    def text(self) -> str:
        """The rule in rule-text form, e.g. ``*embed_tokens=gather:bf16``."""
        if self.source is not None:
            return self.source
        parts = []
        if self.gather is not None:
            parts.append(f"gather:{_axis_text(self.gather)}")
        if self.master is not None:
            parts.append(f"master:{_axis_text(self.master)}")
        return f"{self.select.text()}={','.join(parts)}"


@dataclass(frozen=True)
class PrecisionSpec:
    """An ordered list of rules; ``a + b`` appends ``b``'s rules after ``a``'s (``b`` wins)."""

    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise PrecisionError(f"PrecisionSpec takes Rule objects, got {rule!r}")

    def __add__(self, other: PrecisionSpec) -> PrecisionSpec:
        return PrecisionSpec(self.rules + other.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def text(self) -> str:
        return "; ".join(rule.text() for rule in self.rules)


# ---------------------------------------------------------------------------------------------
# rule text
# ---------------------------------------------------------------------------------------------

_DTYPE_WORDS = (*NAME_TO_DTYPE, "default")
_GLOB_CHARS = re.compile(r"[A-Za-z0-9_.*?\[\]!\-]+")


def _dtype_word(text: str, start: int, word: str) -> AxisDtype:
    key = word.strip()
    if key == "default":
        return DEFAULT
    if key in NAME_TO_DTYPE:
        return NAME_TO_DTYPE[key]
    col = start + (len(word) - len(word.lstrip())) + 1
    raise RuleSyntaxError(text, col, f"a dtype ({', '.join(_DTYPE_WORDS)}), found {key!r}")


def _glob(text: str, start: int, glob: str, what: str) -> str:
    stripped = glob.strip()
    col = start + (len(glob) - len(glob.lstrip())) + 1
    if not stripped and what != "a module FQN glob":
        raise RuleSyntaxError(text, col, f"{what}, found nothing")
    if stripped and not _GLOB_CHARS.fullmatch(stripped):
        bad = next(i for i, ch in enumerate(stripped) if not _GLOB_CHARS.fullmatch(ch))
        raise RuleSyntaxError(text, col + bad, f"{what} (letters, digits, _ . * ? [ ] ! -), found {stripped[bad]!r}")
    return stripped


def _parse_selector(text: str, start: int, sel: str) -> Selector:
    lead = len(sel) - len(sel.lstrip())
    body = sel.strip()
    at = start + lead
    if not body:
        raise RuleSyntaxError(text, at + 1, "a selector (FQN glob, cls:GLOB, param:GLOB or FQN_GLOB&cls:GLOB) before '='")
    if body.startswith("param:"):
        return ParamSel(_glob(text, at + 6, body[6:], "a parameter FQN glob after 'param:'"))
    if body.startswith("cls:"):
        return ModuleSel(cls=_glob(text, at + 4, body[4:], "a class-name glob after 'cls:'"))
    if "&" in body:
        left, right = body.split("&", 1)
        right_at = at + len(left) + 1
        rs = right.lstrip()
        if not rs.startswith("cls:"):
            raise RuleSyntaxError(text, right_at + len(right) - len(rs) + 1, "'cls:GLOB' after '&'")
        fqn = _glob(text, at, left, "a module FQN glob before '&'")
        if not fqn:
            raise RuleSyntaxError(text, at + 1, "a module FQN glob before '&'")
        cls_at = right_at + len(right) - len(rs) + 4
        return ModuleSel(fqn=fqn, cls=_glob(text, cls_at, rs[4:], "a class-name glob after 'cls:'"))
    if ":" in body:
        prefix = body.split(":", 1)[0]
        raise RuleSyntaxError(text, at + 1, f"'param:', 'cls:' or a module FQN glob, found unknown prefix {prefix!r}:")
    return ModuleSel(fqn=_glob(text, at, body, "a module FQN glob"))


def _parse_dtypes(text: str, start: int, spec: str) -> tuple[AxisDtype | None, AxisDtype | None]:
    if not spec.strip():
        raise RuleSyntaxError(text, start + 1, f"dtypes after '=' ({', '.join(_DTYPE_WORDS)} or gather:D,master:D)")
    if ":" not in spec:
        if "," in spec:
            raise RuleSyntaxError(text, start + spec.index(",") + 1, "one bare dtype, or gather:D,master:D for two axes")
        return _dtype_word(text, start, spec), None
    gather: AxisDtype | None = None
    master: AxisDtype | None = None
    offset = start
    for part in spec.split(","):
        lead = len(part) - len(part.lstrip())
        body = part.strip()
        if ":" not in body:
            raise RuleSyntaxError(text, offset + lead + 1, f"'gather:D' or 'master:D', found {body!r}")
        axis, word = body.split(":", 1)
        word_at = offset + lead + len(axis) + 1
        if axis.strip() == "gather":
            if gather is not None:
                raise RuleSyntaxError(text, offset + lead + 1, "each axis once; 'gather' is repeated")
            gather = _dtype_word(text, word_at, word)
        elif axis.strip() == "master":
            if master is not None:
                raise RuleSyntaxError(text, offset + lead + 1, "each axis once; 'master' is repeated")
            master = _dtype_word(text, word_at, word)
        else:
            raise RuleSyntaxError(text, offset + lead + 1, f"axis 'gather' or 'master', found {axis.strip()!r}")
        offset += len(part) + 1
    return gather, master


def parse_precision_rules(text: str) -> PrecisionSpec:
    """Parse rule text (see the module docstring) into a ``PrecisionSpec``.

    Empty text, and empty segments between ``;``, give no rules. A malformed rule raises
    ``RuleSyntaxError`` (a ``PrecisionError``) naming the 1-based column and what was expected.
    """
    rules: list[Rule] = []
    offset = 0
    for segment in text.split(";"):
        if segment.strip():
            if "=" not in segment:
                col = offset + len(segment) - len(segment.lstrip()) + 1
                raise RuleSyntaxError(text, col, "SELECTOR=DTYPES (no '=' in this rule)")
            eq = segment.index("=")
            sel = _parse_selector(text, offset, segment[:eq])
            gather, master = _parse_dtypes(text, offset + eq + 1, segment[eq + 1 :])
            rules.append(Rule(sel, gather=gather, master=master, source=segment.strip()))
        offset += len(segment) + 1
    return PrecisionSpec(tuple(rules))
