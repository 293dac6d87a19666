"""``transformers``, an optional extra: imported where a model needs it, one line naming the install where it is absent.

Its own module so that the checkpoint reader, the model zoo and the arch zoo share it without importing
each other.
"""

from __future__ import annotations

from typing import Any

from fx_precision.errors import PrecisionError

HF_INSTALL_HINT = "pip install 'fx_precision[hf]' (or: pip install transformers)"


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # transformers is an optional extra
        raise PrecisionError(f"this model needs the transformers package: {HF_INSTALL_HINT}") from exc
    return transformers
