"""The one error family of fx_precision.

Every message names the rule, module or parameter at fault and says what to do about it.
``PrecisionError`` subclasses ``ValueError`` so callers that already guard configuration
errors catch it without knowing this package.

A refusal of the backend (``precision_backend`` inside ``torch.compile``) reaches the caller of the compiled
model wrapped by Dynamo: a ``torch._dynamo.exc.BackendCompilerFailed`` whose ``inner_exception`` is the
``PrecisionError``. ``precision_error_in(exc)`` finds it (in that chain, or in ``__cause__``/``__context__``)::

    try:
        compiled(ids)
    except Exception as exc:
        if (refusal := fxp.precision_error_in(exc)) is None:
            raise
        print(refusal)
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


def precision_error_in(exc: BaseException) -> PrecisionError | None:
    """The PrecisionError ``exc`` is or carries: itself, a ``BackendCompilerFailed``'s ``inner_exception``, or one in
    its cause / context chain; None where there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PrecisionError):
            return current
        seen.add(id(current))
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else (current.__cause__ or current.__context__)
    return None


def first_line(exc: BaseException, default: str = "", limit: int = 400) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters), or ``default`` where it has none: what a
    one-line PrecisionError quotes of a library's own failure."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else default
