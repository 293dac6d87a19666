"""What ``compare`` takes as a side: a dump directory (a rank's, or ranks joined), a ``Dump``, or an in-process ``Side``
(a model run under a context, recorded with inputs and replays)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fx_precision.dump import Dump, DumpRecorder, join_ranks, load_dump
from fx_precision.errors import PrecisionError


@dataclass
class Side:
    """An in-process side: ``model(*args, **kwargs)`` under ``context()`` (e.g. an autocast), recorded
    with inputs and replays, so origins and the op-level drill-down are available."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    name: str = ""

    def record(self) -> Dump:
        with torch.no_grad(), self.context(), DumpRecorder(self.model, inputs=True, replay=True) as recorder:
            self.model(*self.args, **self.kwargs)
        recorder.dump.source = self.name or type(self.model).__name__
        return recorder.dump


def as_dump(side: Any, label: str, notes: list[str]) -> Dump:
    if isinstance(side, Dump):
        return side
    if isinstance(side, Side):
        return side.record()
    if isinstance(side, (str, os.PathLike)):
        loaded = load_dump(side)
        if isinstance(loaded, dict):
            joined, note = join_ranks(loaded)
            notes.append(f"side {label}: {note}")
            return joined
        return loaded
    raise PrecisionError(f"side {label}: a dump directory, a Dump or an fx_precision.Side, got {type(side).__name__}")
