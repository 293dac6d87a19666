"""``transformers``, an optional extra: imported where a model needs it, one line naming the install where it is absent.

Its own module so that the checkpoint reader, the model zoo and the arch zoo share it without importing
each other.
"""

from __future__ import annotations

import re
import sys
import traceback
from typing import Any

from fx_precision.errors import PrecisionError

HF_INSTALL_HINT = "pip install 'fx_precision[hf]' (or: pip install transformers)"
TESTED_TRANSFORMERS = "5.24.0 to 5.25.0"  # the releases the suite runs on (CI: the lower bound and the newest)
_MODEL_CODE = ("/transformers/models/", "/transformers/integrations/", "/kernels/")


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # transformers is an optional extra
        raise PrecisionError(f"this model needs the transformers package: {HF_INSTALL_HINT}") from exc
    return transformers


def transformers_version() -> str | None:
    """The imported transformers' version, or None where no model of it is in play."""
    module = sys.modules.get("transformers")
    return getattr(module, "__version__", None) if module is not None else None


def model_code_failure(model: Any, exc: BaseException, doing: str) -> PrecisionError | None:
    """One line for an exception raised inside transformers' model code while fx_precision ``doing`` reads a model
    (its frames, or the user stack Dynamo keeps), naming the architecture, the transformers release, the line and what
    was raised; None for any other exception. A release moves model code every few weeks: a traceback from deep inside
    it tells the user nothing they can act on, and the analysis must never give a silently different answer."""
    version = transformers_version()
    if version is None:
        return None
    frames = list(traceback.extract_tb(exc.__traceback__)) + list(getattr(exc, "real_stack", None) or [])
    where = [f for f in frames if any(part in f.filename.replace("\\", "/") for part in _MODEL_CODE)]
    if not where:
        return None
    frame, cause = where[-1], exc
    while cause.__cause__ is not None:  # Dynamo wraps what the model raised: name that
        cause = cause.__cause__
    text = str(cause)
    raised = re.search(r"got (\w+)\((['\"])(.*?)\2\)", text)  # Dynamo's "failed to run FX node ...: got RuntimeError('...')"
    name, message = (raised.group(1), raised.group(3)) if raised else (type(cause).__name__, text)
    message = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return PrecisionError(
        f"{doing} {type(model).__name__} (transformers {version}) failed in its model code at "
        f"{frame.filename.rsplit('/site-packages/', 1)[-1]}:{frame.lineno} ({name}: {message[:200]}): with inputs "
        f"the model takes eagerly, this release's code is not one fx_precision reads (tested: transformers {TESTED_TRANSFORMERS}); "
        "install a tested release, or report the architecture and this line"
    )
