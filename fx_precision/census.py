"""Eager census: the dtype of every tensor crossing every module boundary, in one forward (+ backward).

    Census (tiny Qwen3.5, fp32 gather, bf16 autocast, as-is)
    ├── totals          {fp32: 57, bf16: 63, int64: 2}
    ├── float           {fp32: 57, bf16: 63}        <- the fp32 share is the leak
    └── entries         one per tensor: module, class, call, direction (in/out/grad_in/grad_out),
                        path (args[0], kwargs.hidden_states, out.logits), dtype, shape

Hooks are forward hooks (they see inputs *after* FSDP2's pre-forward cast, as ``forward`` does)
and tensor gradient hooks for ``backward=True``; they never replace a value and are removed on
exit, also when the forward raises.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fx_precision.callable_module import make_callable
from fx_precision.dtypes import dtype_name, is_analysed_float
from fx_precision.module_graph import module_label


@dataclass(frozen=True)
class CensusEntry:
    module: str
    cls: str
    call: int
    direction: str  # "in" | "out" | "grad_in" | "grad_out"
    path: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def is_float(self) -> bool:
        return self.dtype in ("fp32", "bf16", "fp16", "fp64")


def iter_tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested tuples, lists, dicts and ``ModelOutput``s, with its path."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):  # includes transformers' ModelOutput (an OrderedDict)
        for key, item in value.items():
            yield from iter_tensors(item, f"{path}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from iter_tensors(item, f"{path}[{i}]")


@dataclass
class Census:
    entries: list[CensusEntry] = field(default_factory=list)

    # -- summaries -----------------------------------------------------------------------------
    def totals(self, directions: tuple[str, ...] = ("in", "out")) -> dict[str, int]:
        return dict(Counter(e.dtype for e in self.entries if e.direction in directions).most_common())

    def float_totals(self, directions: tuple[str, ...] = ("in", "out")) -> dict[str, int]:
        return dict(Counter(e.dtype for e in self.entries if e.direction in directions and e.is_float).most_common())

    def count(self, dtype: str, directions: tuple[str, ...] = ("in", "out")) -> int:
        return sum(1 for e in self.entries if e.direction in directions and e.dtype == dtype)

    def module_rows(self) -> list[dict[str, Any]]:
        """Per module: its class and dtype counts of inputs, outputs and gradients."""
        rows: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            row = rows.setdefault(e.module, {"module": e.module, "cls": e.cls, "in": Counter(), "out": Counter(), "grad": Counter()})
            row["grad" if e.direction.startswith("grad") else e.direction][e.dtype] += 1
        return list(rows.values())

    def signature(self) -> dict[str, tuple[tuple[str, str, str], ...]]:
        """Per module, the (direction, path, dtype) of every tensor: what ``diff`` compares."""
        sig: dict[str, list[tuple[str, str, str]]] = {}
        for e in self.entries:
            sig.setdefault(e.module, []).append((e.direction, f"#{e.call}{e.path}", e.dtype))
        return {k: tuple(v) for k, v in sig.items()}

    def diff(self, other: Census) -> list[dict[str, Any]]:
        """Modules whose tensor dtypes differ between ``self`` and ``other`` (with both dtype counts)."""
        mine, theirs = self.signature(), other.signature()
        changed = []
        for module in sorted(set(mine) | set(theirs)):
            if mine.get(module) != theirs.get(module):
                changed.append(
                    {
                        "module": module,
                        "self": dict(Counter(d for _, _, d in mine.get(module, ()))),
                        "other": dict(Counter(d for _, _, d in theirs.get(module, ()))),
                    }
                )
        return changed

    # -- presentation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "totals": self.totals(),
            "float": self.float_totals(),
            "grad_totals": self.totals(("grad_in", "grad_out")),
            "tensors": sum(self.totals().values()),
            "modules": [{**r, "in": dict(r["in"]), "out": dict(r["out"]), "grad": dict(r["grad"])} for r in self.module_rows()],
            "entries": [asdict(e) for e in self.entries],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Census:
        return cls([CensusEntry(**{**e, "shape": tuple(e["shape"])}) for e in data["entries"]])

    def render(self, top: int = 15) -> str:
        rows = sorted(self.module_rows(), key=lambda r: (-(r["in"]["fp32"] + r["out"]["fp32"]), r["module"]))[:top]
        table = tabulate(
            [[module_label(r["module"]), r["cls"], _fmt(r["in"]), _fmt(r["out"]), _fmt(r["grad"]) or "-"] for r in rows],
            headers=["module (top by fp32 IO)", "class", "inputs", "outputs", "grads"],
        )
        totals = self.totals()
        floats = self.float_totals()
        n_float = sum(floats.values())
        share = f"{floats.get('fp32', 0) / n_float:.1%}" if n_float else "-"
        summary = f"module-IO tensors: {sum(totals.values())} ({_fmt(Counter(totals))}); float: {n_float}, fp32 share {share}"
        grads = self.totals(("grad_in", "grad_out"))
        if grads:
            summary += f"\ngradient tensors: {sum(grads.values())} ({_fmt(Counter(grads))})"
        return f"{table}\n{summary}"


def module_class_name(module: nn.Module) -> str:
    """The user's class name, also for FSDP2-wrapped modules (``FSDPQwen3_5DecoderLayer`` -> ``Qwen3_5DecoderLayer``)."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__


def _fmt(counter: Counter[str] | dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1]))


class CensusRecorder:
    """Context manager form, for use inside a training step::

    with CensusRecorder(model, backward=True) as rec:
        loss = model(ids).logits.float().mean(); loss.backward()
    rec.census.render()
    """

    def __init__(self, model: nn.Module, *, backward: bool = False) -> None:
        self.model = model
        self.backward = backward
        self.census = Census()
        self._handles: list[Any] = []
        self._calls: Counter[str] = Counter()

    def _record(self, fqn: str, cls: str, call: int, direction: str, path: str, tensor: torch.Tensor) -> None:
        self.census.entries.append(CensusEntry(fqn, cls, call, direction, path, dtype_name(tensor.dtype), tuple(tensor.shape)))

    def _grad_hook(self, fqn: str, cls: str, call: int, direction: str, path: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._record(fqn, cls, call, direction, path, grad)

        return hook

    def _forward_hook(self, fqn: str, module: nn.Module) -> Any:
        cls = module_class_name(module)

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            call = self._calls[fqn]
            self._calls[fqn] += 1
            for direction, items in (
                ("in", [*iter_tensors(args, "args"), *iter_tensors(kwargs, "kwargs")]),
                ("out", list(iter_tensors(output, "out"))),
            ):
                for path, tensor in items:
                    self._record(fqn, cls, call, direction, path, tensor)
                    if self.backward and tensor.requires_grad and is_analysed_float(tensor.dtype):
                        grad_dir = "grad_in" if direction == "in" else "grad_out"
                        self._handles.append(tensor.register_hook(self._grad_hook(fqn, cls, call, grad_dir, path)))

        return hook

    def __enter__(self) -> CensusRecorder:
        try:
            for fqn, module in self.model.named_modules():
                self._handles.append(module.register_forward_hook(self._forward_hook(fqn, module), with_kwargs=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def census(model: nn.Module, *args: Any, backward: bool = False, **kwargs: Any) -> Census:
    """Run ``model(*args, **kwargs)`` once (under whatever autocast is active) and take the census.

    With ``backward=True`` the mean of the float outputs' sum is back-propagated so gradient
    dtypes are recorded too (parameter ``.grad``s are left populated, as any backward would).
    """
    with CensusRecorder(model, backward=backward) as rec:
        output = model(*args, **kwargs)
        if backward:
            floats = [t for _, t in iter_tensors(output, "out") if t.requires_grad and is_analysed_float(t.dtype)]
            if floats:
                sum(t.float().sum() for t in floats).backward()  # type: ignore[union-attr]
    return rec.census


make_callable(__name__, census)  # fxp.census(...) calls the function; import fx_precision.census binds this module
