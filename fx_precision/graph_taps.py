"""Module records from inside a compiled graph: taps that read the stream and never rewrite it.

``DumpRecorder`` records an eager forward with module hooks. Under ``torch.compile`` a hook that runs
Python code breaks the graph at every module, and graph-level rewrites (the engine contract's) then see
other graphs than the model compiles to. ``TapRecorder`` registers hooks Dynamo traces instead: each calls
one side-effecting custom op per tensor, which the compiled graph keeps in place and which copies the
tensor out when the graph runs::

    with TapRecorder(model, only={"model.layers.0.mlp", ...}) as taps:     before the first compiled call
        compiled(input_ids=ids)                                             the same graphs, plus taps
    taps.dump                                                               records and calls, as DumpRecorder's

    fxp_tap::record(sink, x, fqn, io, path, event)      event: CALL_START | TENSOR | CALL_END
        the sink is a one-element int32 buffer the op marks mutated, so no pass drops the tap or moves it past
        another; x is only read (a copy goes to the recorder entered in this thread)

Calls are numbered per module and clocked when they start and end, as ``DumpRecorder`` does, so the
comparator's origins (inputs equal, output differs) and nesting work on these records unchanged.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from fx_precision.dtypes import dtype_name
from fx_precision.dump import CallInfo, Dump, Record
from fx_precision.errors import PrecisionError

CALL_START, TENSOR, CALL_END = 0, 1, 2
_SINK = torch.zeros(1, dtype=torch.int32)  # what every tap marks mutated (never read)
_ACTIVE = threading.local()


@torch.library.custom_op("fxp_tap::record", mutates_args=("sink",))
def tap(sink: torch.Tensor, x: torch.Tensor, fqn: str, io: str, path: str, event: int) -> None:
    """Hand ``x`` to the recorder entered in this thread (nothing when none is)."""
    recorder = getattr(_ACTIVE, "recorder", None)
    if recorder is not None:
        recorder.receive(x, fqn, io, path, event)


@tap.register_fake
def _(sink, x, fqn, io, path, event):
    return None


def _tensors(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in nested tuples, lists and dicts (``ModelOutput`` included), with its path: a list, which
    Dynamo traces as plain Python."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, dict):
        for key in list(value.keys()):
            out += _tensors(value[key], f"{path}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            out += _tensors(item, f"{path}[{i}]")
    return out


class TapRecorder:
    """Traceable hooks on every module of ``model`` (or the FQNs in ``only``, the root always); see the module
    docstring. Entered once, around the forwards it records; the hooks stay until exit."""

    def __init__(self, model: nn.Module, *, only: Collection[str] | None = None, inputs: bool = True) -> None:
        self.model = model
        self.only = set(only) if only is not None else None
        self.inputs = inputs
        self.dump = Dump(type(model).__name__, inputs=inputs, source="train, compiled (graph taps)")
        self._handles: list[Any] = []
        self._calls: Counter[str] = Counter()
        self._open: dict[str, list[tuple[int, int]]] = {}
        self._clock = 0

    def receive(self, x: torch.Tensor, fqn: str, io: str, path: str, event: int) -> None:
        if event == CALL_START:
            call = self._calls[fqn]
            self._calls[fqn] += 1
            self._clock += 1
            self._open.setdefault(fqn, []).append((call, self._clock))
            return
        if event == CALL_END:
            call, start = self._open[fqn].pop()
            self._clock += 1
            self.dump.calls.append(CallInfo(fqn, call, start, self._clock))
            return
        if io == "out" and not x.is_floating_point():
            return
        call = self._open[fqn][-1][0]
        tensor = x.detach().cpu().clone()
        self.dump.records.append(Record(fqn, call, io, path, dtype_name(tensor.dtype), tuple(tensor.shape), tensor))

    def _hooks(self, fqn: str) -> tuple[Any, Any]:
        record_inputs = self.inputs or fqn == ""

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            torch.ops.fxp_tap.record(_SINK, _SINK, fqn, "", "", CALL_START)
            if record_inputs:
                for path, t in _tensors(args, "args") + _tensors(kwargs, "kwargs"):
                    torch.ops.fxp_tap.record(_SINK, t, fqn, "in", path, TENSOR)

        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            for path, t in _tensors(output, "out"):
                torch.ops.fxp_tap.record(_SINK, t, fqn, "out", path, TENSOR)
            torch.ops.fxp_tap.record(_SINK, _SINK, fqn, "", "", CALL_END)

        return pre, post

    def __enter__(self) -> TapRecorder:
        if getattr(_ACTIVE, "recorder", None) is not None:
            raise PrecisionError("a TapRecorder is recording in this thread already; record one model at a time")
        _ACTIVE.recorder = self
        try:
            for fqn, module in self.model.named_modules():
                if fqn and self.only is not None and fqn not in self.only:
                    continue
                pre, post = self._hooks(fqn)
                self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post, with_kwargs=True))
        except BaseException:
            self.__exit__(None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ACTIVE.recorder = None
