"""Capturing a model's Dynamo graphs for analysis: real tensors, meta-device models, fake tensors.

    lint(model, ids)                          Dynamo (fullgraph=False) ─▶ graph 0, graph 1, … (one per break)
    ├── real parameters                       traced as they are
    ├── meta parameters (no weights)          swapped for fake tensors on the analysed device type
    │                                         (cpu / cuda), so autocast sees what that device runs
    └── fake parameters (FakeTensorMode)      traced inside their own fake mode

PyTorch does not autocast meta tensors; a fake tensor on ``cpu`` or ``cuda`` carries that
device's autocast dispatch key while allocating nothing.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from fx_precision.errors import PrecisionError
from fx_precision.hf import model_code_failure
from fx_precision.passes.graph.kinds import ParamKind


@dataclass
class Captured:
    gm: fx.GraphModule
    example_inputs: list[Any]


def tensor_names(model: nn.Module) -> dict[int, tuple[str, ParamKind]]:
    """``id(tensor) -> (fqn, "parameter" | "buffer")`` for every parameter and buffer."""
    names: dict[int, tuple[str, ParamKind]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (fqn, ParamKind.PARAMETER))
    for fqn, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), (fqn, ParamKind.BUFFER))
    return names


def _is_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _faked(fake_mode: FakeTensorMode, device_type: str, inputs: Any) -> Any:
    """``inputs`` (any pytree) with each tensor a fake one of its shape, strides and dtype on ``device_type``."""

    def to_fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            with fake_mode:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device_type)
        return x

    return tree_map(to_fake, inputs)


@contextlib.contextmanager
def _fake_weights(model: nn.Module, fake_mode: FakeTensorMode, device_type: str) -> Iterator[None]:
    """Swap every meta parameter/buffer for a fake tensor on ``device_type``; restore afterwards."""
    saved: list[tuple[nn.Module, str, str, Any]] = []
    memo: dict[int, Any] = {}
    try:
        with fake_mode:
            for module in model.modules():
                for kind in ("_parameters", "_buffers"):
                    table = getattr(module, kind)
                    for name, value in list(table.items()):
                        if value is None or value.device.type != "meta":
                            continue
                        if id(value) not in memo:
                            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device_type)
                            memo[id(value)] = nn.Parameter(fake, requires_grad=value.requires_grad) if kind == "_parameters" else fake
                        saved.append((module, kind, name, value))
                        table[name] = memo[id(value)]
        yield
    finally:
        for module, kind, name, value in saved:
            getattr(module, kind)[name] = value


@contextlib.contextmanager
def _users_dynamo_state_kept() -> Iterator[None]:
    """Dynamo's shape history (automatic dynamic: a frame seen at other sizes compiles dynamic next time) as it was
    before: a capture's sizes (a full-size meta model's) never decide how the user's next compile of the same code
    traces. Compiled code is left alone anyway: each cache entry answers to the backend that made it."""
    from torch._dynamo import pgo

    saved = copy.deepcopy(pgo._CODE_STATE)
    try:
        yield
    finally:
        pgo._CODE_STATE = saved


def _isolated_compile(model: nn.Module, backend: Any, dynamic: bool) -> Any:
    """``torch.compile`` in a recompile region of its own where this torch has them (2.13: ``isolate_recompiles``)."""
    compile_fn: Any = torch.compile
    isolated = "isolate_recompiles" in inspect.signature(torch.compile).parameters
    return compile_fn(model, backend=backend, dynamic=dynamic, **({"isolate_recompiles": True} if isolated else {}))


def capture_graphs(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, dynamic: bool, device_type: str, autocast: Any
) -> tuple[list[Captured], dict[int, tuple[str, ParamKind]]]:
    """Run ``model(*args, **kwargs)`` once under Dynamo and keep every graph it hands a backend.

    Dynamo's caches are left as they are: the capture compiles in a region of its own (``isolate_recompiles``: its
    entries neither count against the user's recompile limit nor answer a later lookup), a function the user
    compiled keeps its compiled code (no recompilation on its next call), and the shape history that decides
    automatic dynamic shapes is restored after. Returns the graphs and ``id(tensor) -> (fqn, kind)``.
    """
    graphs: list[Captured] = []

    def recorder(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(Captured(gm, list(example_inputs)))
        return gm.forward

    try:
        names = _capture(model, args, kwargs, recorder, dynamic=dynamic, device_type=device_type, autocast=autocast)
    except PrecisionError:
        raise
    except Exception as exc:  # the model's own code: one line where it is transformers' (a release that moved it)
        failure = model_code_failure(model, exc, "capturing the graphs of")
        if failure is None:
            raise
        raise failure from exc
    if not graphs:
        raise PrecisionError(
            f"Dynamo captured no graph from {type(model).__name__}; is the forward decorated with torch.compiler.disable, "
            "or did every frame fall back to eager?"
        )
    return graphs, names


def _capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], recorder: Any, *, dynamic: bool, device_type: str,
             autocast: Any) -> dict[int, tuple[str, ParamKind]]:  # fmt: skip
    kept = _users_dynamo_state_kept()
    existing_fake = detect_fake_mode([*model.parameters(), *model.buffers()])
    if _is_meta(model):
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args, fake_kwargs = _faked(fake_mode, device_type, (args, kwargs))
        with _fake_weights(model, fake_mode, device_type):
            names = tensor_names(model)
            with kept, fake_mode, autocast:
                _isolated_compile(model, recorder, dynamic)(*fake_args, **fake_kwargs)
    else:
        names = tensor_names(model)
        ctx = existing_fake if existing_fake is not None else contextlib.nullcontext()
        with kept, ctx, autocast:
            _isolated_compile(model, recorder, dynamic)(*args, **kwargs)
    return names


ModuleIO = dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]]


class _Recorded(Exception):
    """Every module asked for has returned: the rest of the forward is not needed."""


def fake_forward_io(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, device_type: str, autocast: Any, modules: set[str]
) -> ModuleIO:
    """One eager forward (fake tensors for a meta model; no_grad otherwise) recording, for each module
    FQN in ``modules``, the output tensors of its first call: ``(path, shape, dtype)``. It stops as
    soon as the last of them returns. How a graph node of a module is found among that module's
    outputs (the eager fix hooks outputs by path)."""
    from fx_precision.census import iter_tensors

    seen: ModuleIO = {}
    handles = []
    if not modules:
        return seen

    def recorder(fqn: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if fqn not in seen:
                seen[fqn] = [(path, tuple(int(s) for s in t.shape), t.dtype) for path, t in iter_tensors(output, "out")]
            if modules <= seen.keys():
                raise _Recorded

        return hook

    for fqn, module in model.named_modules():
        if fqn in modules:
            handles.append(module.register_forward_hook(recorder(fqn)))
    try:
        if _is_meta(model):
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake_args, fake_kwargs = _faked(fake_mode, device_type, (args, kwargs))
            with _fake_weights(model, fake_mode, device_type), fake_mode, torch.no_grad(), autocast:
                model(*fake_args, **fake_kwargs)
        else:
            with torch.no_grad(), autocast:
                model(*args, **kwargs)
    except _Recorded:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen
