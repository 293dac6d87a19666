"""The one error family of fx_precision.

Every message names the rule, module or parameter at fault and says what to do about it.
``PrecisionError`` subclasses ``ValueError`` so callers that already guard configuration
errors catch it without knowing this package.
"""

from __future__ import annotations


class PrecisionError(ValueError):
    """A precision spec, plan, policy or compiled graph breaks the contract."""


class RuleSyntaxError(PrecisionError):
    """Rule text that does not parse; carries the 1-based column of the fault."""

    def __init__(self, text: str, column: int, expected: str) -> None:
        self.text = text
        self.column = column  # 1-based, over the whole text
        self.expected = expected
        before = text[: column - 1]
        self.line = before.count("\n") + 1
        self.line_column = column - (before.rfind("\n") + 1)
        shown = text.split("\n")[self.line - 1]
        where = f"line {self.line}, column {self.line_column}" if "\n" in text else f"column {column}"
        pointer = " " * (self.line_column - 1) + "^"
        super().__init__(f"rule text, {where}: expected {expected}\n  {shown}\n  {pointer}")
