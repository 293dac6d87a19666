"""Re-run fake-tensor propagation over a Dynamo graph after it changed, under its autocast state.

The graph's placeholders keep their fake example values; every other node's
``meta["example_value"]`` is recomputed by interpreting the graph on them inside the graph's fake
mode and ``torch.autocast(device_type, compute)``, so a cast inserted upstream shows in every
dtype downstream.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from fx_precision.autocast import autocast_context
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import module_label
from fx_precision.passes.graph.nodes import module_path, node_value, op_name, source_line


def graph_device_type(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        value = node_value(node)
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


class _Propagate(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, fake_mode: Any) -> None:
        super().__init__(gm)
        self.fake_mode = fake_mode

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and self.fake_mode is not None and not isinstance(value, FakeTensor):
            return self.fake_mode.from_tensor(value)
        return value

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:  # name the node, as torch.fx.passes.shape_prop does
            where = source_line(n) or "no source line"
            raise PrecisionError(
                f"re-propagating dtypes after the pass's casts failed at node {n.name} ({op_name(n)}) in module "
                f"{module_label(module_path(n))}, {where}: {type(exc).__name__}: {exc}. Please report the model; "
                "meanwhile make_precision_backend(mode='lint') compiles it unchanged"
            ) from exc
        if n.op not in ("placeholder", "output"):
            n.meta["example_value"] = result
        return result


def repropagate(gm: fx.GraphModule, compute: torch.dtype | None, device_type: str | None = None) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [node_value(n) for n in placeholders]
    # the mode the node metadata lives in; inside a backend the TracingContext already holds the
    # fresh fake mode Dynamo made for the backend, which must not be mixed with these values
    fakes = [v for v in values if isinstance(v, FakeTensor)]
    fake_mode = fakes[0].fake_mode if fakes else detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    device_type = device_type or graph_device_type(gm)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    # no_grad: only dtypes are wanted, and the user's autograd hooks (saved-tensor hooks) must not see fakes
    with ctx, torch.no_grad(), autocast_context(compute, device_type if device_type != "meta" else "cpu"):
        _Propagate(gm, fake_mode).run(*values)
