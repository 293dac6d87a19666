"""Applying a ``PrecisionPlan`` with FSDP2: fp32-master conversion, then one ``fully_shard`` per unit.

    plan.units (inner first)                    fully_shard(module, mp_policy=...)
    model.embed_tokens   gather bf16   ──▶      MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=…)
    model.layers.0..N    gather fp32   ──▶      MixedPrecisionPolicy(param_dtype=fp32, …)
    <root>               gather fp32   ──▶      MixedPrecisionPolicy(param_dtype=fp32, …)

Everything is validated before the first ``fully_shard``; on a bad plan the model is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fx_precision.dtypes import axis_dtype
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import module_label
from fx_precision.plan import PrecisionPlan, check_plan_matches

if TYPE_CHECKING:
    from fx_precision.policy import PrecisionPolicy


def _fsdp() -> Any:
    from torch.distributed import fsdp

    return fsdp


def layer_wrap_globs(model: nn.Module) -> list[str]:
    """The conventional per-layer wrap: each child of the largest homogeneous ``ModuleList``.

    For ``transformers`` decoders that is ``model.layers.*``.
    """
    best: tuple[int, str] | None = None
    for fqn, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and fqn:
            kinds = {type(child).__name__ for child in module}
            numel = sum(p.numel() for p in module.parameters())
            if len(kinds) <= 2 and numel and (best is None or numel > best[0]):
                best = (numel, fqn)
    return [f"{best[1]}.*"] if best else []


def _check_mesh(mesh: Any) -> None:
    """A 1-D ``DeviceMesh`` (FSDP), a 2-D one (HSDP: replicate x shard), or None with a default process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PrecisionError(
                "apply_fsdp2(mesh=None) uses the default process group, and none is initialised; call "
                "torch.distributed.init_process_group (torchrun does) or pass mesh=init_device_mesh(...)"
            )
        return
    if not isinstance(mesh, DeviceMesh):
        raise PrecisionError(f"apply_fsdp2(mesh={mesh!r}): pass a torch.distributed DeviceMesh (init_device_mesh) or None")
    if mesh.ndim not in (1, 2):
        raise PrecisionError(f"apply_fsdp2: a {mesh.ndim}-D mesh; FSDP2 takes 1-D (shard) or 2-D (HSDP: replicate x shard)")


def _check_applicable(model: nn.Module, plan: PrecisionPlan, mesh: Any) -> None:
    """The plan belongs to the model (``check_plan_matches``), the mesh is usable, and the model is
    plain: no module already sharded, no DTensor or meta parameter."""
    check_plan_matches(plan, model)
    _check_mesh(mesh)
    fsdp = _fsdp()
    for fqn, module in model.named_modules():
        if isinstance(module, fsdp.FSDPModule):
            raise PrecisionError(f"module {module_label(fqn)!r} is already wrapped by fully_shard; apply_fsdp2 wraps a plain model once")
    for fqn, p in model.named_parameters():
        if type(p.data).__name__ == "DTensor" or p.device.type == "meta":
            raise PrecisionError(
                f"parameter {fqn} is a {'DTensor' if p.device.type != 'meta' else 'meta tensor'}; "
                "apply_fsdp2 needs a plain model with materialised parameters"
            )


def apply_fsdp2(
    model: nn.Module,
    plan: PrecisionPlan,
    *,
    mesh: Any,
    policy: PrecisionPolicy | None = None,
    reduce_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool | None = None,
    reshard_after_forward: bool = True,
    offload_policy: Any = None,
) -> None:
    """Convert each parameter to its master dtype, then ``fully_shard`` every unit in plan order.

    ``policy`` supplies the reduce dtype and ``cast_forward_inputs`` (False exactly when an autocast
    compute dtype is set: FSDP2's boundary re-cast would undo it). With no policy no autocast is
    assumed: reduce fp32, ``cast_forward_inputs=True`` (FSDP2's own default). ``reduce_dtype`` /
    ``cast_forward_inputs`` given explicitly win over the policy. ``fsdp_units(model)`` reads back
    what was applied.
    """
    fsdp = _fsdp()
    _check_applicable(model, plan, mesh)
    if reduce_dtype is None:
        reduce_dtype = policy.reduce if policy is not None else torch.float32
    if cast_forward_inputs is None:
        cast_forward_inputs = bool(policy.cast_forward_inputs) if policy is not None else True
    reduce_dtype = axis_dtype(reduce_dtype, "apply_fsdp2 reduce_dtype")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    # -- everything below mutates; everything above only validated ----------------------------
    with torch.no_grad():
        for fqn, planned in plan.params.items():
            param = params[fqn]
            if param.dtype != planned.master:
                param.data = param.data.to(planned.master)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for unit in plan.units:
        mp = fsdp.MixedPrecisionPolicy(param_dtype=unit.gather, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs)
        target = [modules[fqn] for fqn in unit.group] if unit.group else modules[unit.fqn]  # a group: one fully_shard, several modules
        fsdp.fully_shard(target, mp_policy=mp, **kwargs)


def fsdp_units(model: nn.Module) -> list[tuple[str, Any]]:
    """``[(fqn, MixedPrecisionPolicy)]`` of every ``fully_shard``-ed module, in module order."""
    fsdp = _fsdp()
    out = []
    for fqn, module in model.named_modules():
        if isinstance(module, fsdp.FSDPModule):
            out.append((fqn, module._get_fsdp_state()._mp_policy))
    return out


@contextlib.contextmanager
def gathered_eagerly(model: nn.Module, plan: PrecisionPlan) -> Iterator[None]:
    """Eager gather emulation on one device, as FSDP2 gathers: every call of the model sees each
    parameter at its planned gather dtype (a cast of the master, differentiable), however the forward
    reaches it: through its module, or directly (GatedDeltaNet reads ``self.conv1d.weight`` itself)."""
    from torch.nn.utils.stateless import _reparametrize_module

    names = {fqn: plan.param(fqn).gather for fqn, p in model.named_parameters() if p.is_floating_point()}
    names = {fqn: dtype for fqn, dtype in names.items() if model.get_parameter(fqn).dtype != dtype}  # only what differs
    if not names:
        yield
        return
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        cast = {fqn: model.get_parameter(fqn).to(dtype) for fqn, dtype in names.items()}
        with _reparametrize_module(model, cast, tie_weights=True):
            return original(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        model.forward = original
