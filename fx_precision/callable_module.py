"""A module you can call as its namesake function: ``fxp.lint(model, ids)`` and ``import fx_precision.lint``.

``census``, ``lint``, ``dump`` and ``compare`` are each a function and the module that holds it.
Importing a submodule binds it on the package, so the package's name must be the module; making
the module callable keeps ``fxp.lint(...)`` working and ``import fx_precision.lint as m`` binding
the module (``m.LintReport``, ``m.lint``), with no import hook and no special package class.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose call is its ``__call_target__`` (the function it is named after)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["__call_target__"](*args, **kwargs)


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    """Let ``sys.modules[module_name](...)`` call ``function``; its docstring becomes the call's help."""
    module = sys.modules[module_name]
    module.__call_target__ = function  # type: ignore[attr-defined]
    module.__class__ = CallableModule
