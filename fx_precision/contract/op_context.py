"""What ``torch.library`` hands a custom op's ``setup_context`` and ``backward``: one context per call, typed.

OpContext
├── save_for_backward(*tensors)    the tensors the backward reads (``saved_tensors`` there)
└── any other attribute            what the setup keeps for the backward (shapes, dtypes, flags): set in the
                                   setup, read in the backward, of the type the setup gave it
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class OpContext(Protocol):
    saved_tensors: tuple[torch.Tensor, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...

    def __setattr__(self, name: str, value: object) -> None: ...

    def __getattr__(self, name: str) -> Any: ...  # what the setup kept: its own type, not declared here
