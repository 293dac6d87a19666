"""``aot_eager`` with one repair, for tiny Qwen3.5's backward on CPU.

torch 2.13's ``aot_eager`` fails tiny Qwen3.5's backward with "view size is not compatible with
input tensor's size and stride": the eager ``softplus_backward`` kernel (GatedDeltaNet's
``softplus(a + dt_bias)``) returns strides its meta function did not predict, and the traced
``aten.view`` then refuses them. Plain ``torch.compile(model, backend="aot_eager")`` fails the same
way without fx_precision. This inner compiler is aot_eager (nop forward/backward compilers, the
default partitioner) with every ``aten.view`` replaced by ``aten.reshape``, which yields the same
values whatever the strides, so it keeps eager numerics bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func


def _views_to_reshapes(gm: fx.GraphModule, example_inputs: Any) -> Any:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return make_boxed_func(gm.forward)


aot_eager_reshape = aot_autograd(fw_compiler=_views_to_reshapes, bw_compiler=_views_to_reshapes)
