"""The throughput benchmark: what the fp32 leak costs under default Inductor, what the backend wins back.

    variants (fp32 master weights, bf16 autocast unless said)
    ├── eager as-is                 fp32 gather: the embedding seeds an fp32 stream
    ├── eager both fixes            embedding gathered (cast at use) at bf16
    ├── inductor                    torch.compile, default Inductor
    ├── precision_backend + plan    torch.compile(backend=precision_backend), embedding gathered at bf16
    ├── precision_backend           the same with no plan rule: the pass casts the embedding's output
    ├── pure bf16 limit             the whole model converted to bf16, default Inductor
    ├── per-block backend           each decoder layer compiled alone (the FSDP2 style), embedding eager:
    │                               every block graph receives the embedding's fp32 stream
    └── per-block + eager fix       the same with the derived hooks (fxp.eager_casts) on the eager parts

    per variant: fwd+bwd step time (median, min-max), tokens/s, ratio to Inductor; generated kernels
    and how many touch an fp32 activation buffer; kernel bytes by dtype (externs apart); float
    bytes saved for backward; peak memory (CUDA); compile time and the pass's share.

Every figure is measured in the run that prints it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from fx_precision.archs import input_embedding_fqns
from fx_precision.archs.moe_experts import experts_at_compute_dtype
from fx_precision.backend import make_precision_backend
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.fsdp import gathered_eagerly
from fx_precision.logprobs import logits_of
from fx_precision.lowering import compile_precision
from fx_precision.plan import PrecisionPlan
from fx_precision.policy import PrecisionPolicy
from fx_precision.spec import parse_precision_rules
from fx_precision.tools.kernel_census import census_of_code, per_token_size, summary
from fx_precision.tools.zoo import build_model, forward_kwargs, token_batch, vocab_size
from fx_precision.training_side import compile_limits

EMBED_RULE = "<input embeddings>=bf16"  # by role: input_embedding_fqns(model), whatever they are named
EXPERTS_RULE = "<stacked MoE experts>=bf16"  # by what they hold: archs.moe_experts (where the model has them)


def embedding_rules(model: nn.Module) -> str:
    """Rule text gathering the model's input embeddings (found by role) at bf16, and its stacked MoE experts
    (grouped_mm: autocast does not cover them either) where it has them and bf16 grouped_mm runs their sizes."""
    fqns = input_embedding_fqns(model)
    if not fqns:
        raise PrecisionError(
            f"{type(model).__name__} has no input embedding (no get_input_embeddings(), no nn.Embedding): the bench's "
            "plan variant gathers the embedding at bf16; give the model one or bench another model"
        )
    experts = experts_at_compute_dtype(getattr(model, "config", None), PrecisionPolicy(compute=torch.bfloat16), model)
    return "; ".join([f"{fqn}=bf16" for fqn in fqns] + [f"{rule.select.text()}=bf16" for rule in experts.rules])


@dataclass(frozen=True)
class Variant:
    """One row of the benchmark and how it runs: the model's weights, the compile, the eager gather."""

    name: str
    compiled: bool
    meaning: str
    weights: torch.dtype | None = None  # convert the whole model (the pure-bf16 limit); None: fp32 masters
    backend: str | None = None  # None: default Inductor; "plan": precision_backend with the embedding plan; "pass": no plan
    gather_eagerly: bool = False  # eager gather emulation of the embedding plan
    per_block: bool = False  # compile each decoder layer alone (the FSDP2 style); the rest of the model runs eagerly
    eager_fix: bool = False  # the backend's casts as module hooks (fxp.eager_casts) on the eager parts

    def make_backend(self, plan: PrecisionPlan) -> Any:
        if self.backend is None:
            return None
        return make_precision_backend(plan=plan if self.backend == "plan" else None)


VARIANTS = (
    Variant("eager as-is", False, "fp32 gather: F.embedding seeds an fp32 stream"),
    Variant("eager both fixes", False, "embedding gathered at bf16 (cast at use)", gather_eagerly=True),
    Variant("inductor", True, "torch.compile, default Inductor"),
    Variant("precision_backend + plan", True, f"backend with plan '{EMBED_RULE}' (MoE: and '{EXPERTS_RULE}')", backend="plan"),
    Variant("precision_backend", True, "backend, no plan: casts the embedding output", backend="pass"),
    Variant("pure bf16 limit", True, "model converted to bf16, default Inductor", weights=torch.bfloat16),
    Variant("per-block backend", True, "each decoder layer compiled alone, backend; embedding eager", backend="pass", per_block=True),
    Variant(
        "per-block backend + eager fix",
        True,
        "the same, with the derived hooks on the eager embedding",
        backend="pass",
        per_block=True,
        eager_fix=True,
    ),
)


# ---------------------------------------------------------------------------------------------
# machine
# ---------------------------------------------------------------------------------------------


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        text = open("/proc/cpuinfo").read()
        for line in text.splitlines():
            if line.startswith("model name") and "cpu" not in info:
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    info["cpu_cores"] = os.cpu_count()
    info["cpu_native_bf16"] = bool(flags & {"avx512_bf16", "amx_bf16"})
    info["cpu_bf16_flags"] = sorted(flags & {"avx512_bf16", "amx_bf16", "avx512f", "avx2"})
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


class _SavedBytes:
    """Float bytes autograd saves for backward during a forward (parameters excluded, deduplicated).

    *Activations* are the per-token tensors among them. A tensor shaped like a parameter (or its
    transpose) is not one, even when a dimension equals the token count: autocast's bf16 copy of
    an fp32 master weight is saved for backward too, and in the quick bench the tiny Qwen3.5's
    (128, 48) MLP weights have exactly 2 x 64 = 128 rows.
    """

    def __init__(self, params: set[int], tokens: int, param_shapes: set[tuple[int, ...]]) -> None:
        self.params = params
        self.tokens = tokens
        self.param_shapes = param_shapes
        self.packed: list[weakref.ref[torch.Tensor]] = []
        self.by_dtype: Counter[str] = Counter()
        self.activations: Counter[str] = Counter()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point and t.untyped_storage().data_ptr() not in self.params:
            self.packed.append(weakref.ref(t))
        return t

    def count(self) -> None:
        """At the end of the forward: what autograd still holds, each storage once. A tensor a subgraph saved and
        dropped mid-forward (its output unused) is gone; counting at pack time, keyed by address, let the allocator's
        reuse of its memory decide whether a later tensor was counted, so eager runs differed by ~1 %."""
        gc.collect()  # a dropped subgraph caught in a reference cycle is gone too, whenever the collector would run
        seen: set[tuple[int, int, torch.dtype]] = set()
        for ref in self.packed:
            t = ref()
            if t is None:
                continue
            key = (t.untyped_storage().data_ptr(), t.numel(), t.dtype)  # every one alive: an address names one storage
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.numel() * t.element_size()
            self.by_dtype[dtype_name(t.dtype)] += nbytes
            shape = tuple(t.shape)
            weight_like = shape in self.param_shapes or shape[::-1] in self.param_shapes
            if not weight_like and per_token_size(shape, self.tokens) is not None:
                self.activations[dtype_name(t.dtype)] += nbytes
        self.packed.clear()


def stream_width(model: nn.Module) -> int:
    """The residual-stream width: ``config.hidden_size``, else the first embedding's dimension."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:
        return int(hidden)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise PrecisionError(
            f"{type(model).__name__}: no config.hidden_size and no nn.Embedding to read the residual-stream width from; "
            "give the model a config.hidden_size"
        )
    return embedding.embedding_dim


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_steps(
    step: Callable[..., None], variant: Variant, device: str, steps: int, warmup: int, codes: list[str]
) -> tuple[list[float], float]:
    """First step (compiles; its generated code lands in ``codes``), warm-up, then ``steps`` timed ones."""
    start = time.perf_counter()
    if variant.compiled:
        from torch._inductor.utils import run_and_get_code

        _, generated = run_and_get_code(step)
        codes.extend(generated)
    else:
        step()
    _sync(device)
    first_step = time.perf_counter() - start
    step(record=True)  # warm-up, and the saved-for-backward census
    for _ in range(warmup - 1):
        step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times, first_step


def inductor() -> Callable[..., Any]:
    """Default Inductor as a backend object of its own: Dynamo keeps a compiled frame for the backend that compiled it, so
    each variant's model is traced afresh (the hooks of an eager fix in it) without resetting Dynamo."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs)

    return backend


def run_variant(variant: Variant, *, model_name: str, batch: int, seq_len: int, steps: int, device: str, warmup: int = 1) -> dict[str, Any]:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(model_name, seed=0).to(device)
    if variant.weights is not None:
        model.to(variant.weights)
    ids = token_batch(model, batch=batch, seq_len=seq_len, seed=1, device=device)
    kwargs = forward_kwargs(model)
    plan = compile_precision(model, parse_precision_rules(embedding_rules(model)), default_gather="fp32")
    backend = variant.make_backend(plan)
    forward: Callable[..., Any] = model
    hooks = None
    if variant.eager_fix:
        from fx_precision.eager_fix import eager_casts

        hooks = eager_casts(model, ids, policy=PrecisionPolicy(compute=torch.bfloat16), **kwargs).apply(model)
    if variant.per_block:
        from fx_precision.fsdp import layer_wrap_globs

        for glob in layer_wrap_globs(model):
            for layer in model.get_submodule(glob.removesuffix(".*")).children():
                layer.compile(backend=backend or inductor(), dynamic=False)  # in place: the FSDP2 style, one graph per block
    elif variant.compiled:
        forward = torch.compile(model, backend=backend or inductor(), dynamic=False)
    fix = gathered_eagerly(model, plan) if variant.gather_eagerly else contextlib.nullcontext()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = _SavedBytes(params, batch * seq_len, {tuple(p.shape) for p in model.parameters()})

    def step(record: bool = False) -> None:
        for p in model.parameters():
            p.grad = None
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if record else contextlib.nullcontext()
        with torch.autocast(device, dtype=torch.bfloat16), hooks:
            logits = logits_of(forward(ids, **kwargs))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        if record:
            saved.count()
        loss.backward()

    codes: list[str] = []
    with fix, hooks if hooks is not None else contextlib.nullcontext():
        times, first_step = _timed_steps(step, variant, device, steps, warmup, codes)
    median = statistics.median(times)
    result: dict[str, Any] = {
        "variant": variant.name,
        "meaning": variant.meaning,
        "step_seconds": {"median": median, "min": min(times), "max": max(times), "n": len(times)},
        "tokens_per_second": batch * seq_len / median,
        "saved_for_backward_bytes": dict(saved.by_dtype),
        "saved_for_backward_bytes_total": sum(saved.by_dtype.values()),
        "saved_activation_bytes": dict(saved.activations),
        "saved_activation_bytes_total": sum(saved.activations.values()),
    }
    if device == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    if variant.compiled:
        param_shapes = {tuple(p.shape) for p in model.parameters()}
        widths = {stream_width(model), vocab_size(model)}
        result["kernels"] = summary(census_of_code(codes), tokens=batch * seq_len, param_shapes=param_shapes, stream_widths=widths)
        pass_seconds = sum(r.pass_seconds for r in backend.reports) if backend is not None else 0.0
        compile_seconds = max(first_step - median, 0.0)
        result["compile_seconds"] = compile_seconds
        result["pass_seconds"] = pass_seconds
        result["pass_share_of_compile"] = pass_seconds / compile_seconds if compile_seconds else None
        if backend is not None:
            result["graphs"] = len(backend.reports)
            result["casts"] = [c.to_dict() for r in backend.reports for c in r.casts]
    return result  # the model and its compiled forward go out of scope here


def run_benchmark(
    *, model_name: str, batch: int, seq_len: int, steps: int, device: str, variants: tuple[Variant, ...] = VARIANTS
) -> dict[str, Any]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # every variant compiles from scratch: no FX-graph / AOT-autograd cache hits across variants, and each its own
    # backend (a fresh Dynamo trace: no reset of the caller's Dynamo) within a recompile limit for them all
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), compile_limits(64):
        rows = [run_variant(v, model_name=model_name, batch=batch, seq_len=seq_len, steps=steps, device=device) for v in variants]
    by_name = {r["variant"]: r for r in rows}
    base = by_name.get("inductor")
    limit = by_name.get("pure bf16 limit")
    for r in rows:
        if base:
            r["time_vs_inductor"] = r["step_seconds"]["median"] / base["step_seconds"]["median"]
            r["saved_bytes_vs_inductor"] = r["saved_for_backward_bytes_total"] / max(base["saved_for_backward_bytes_total"], 1)
            r["saved_activation_bytes_vs_inductor"] = r["saved_activation_bytes_total"] / max(base["saved_activation_bytes_total"], 1)
        if "kernels" in r and base and limit:
            r["activation_bytes_vs_inductor"] = r["kernels"]["activation_bytes_total"] / max(base["kernels"]["activation_bytes_total"], 1)
            r["activation_bytes_vs_limit"] = r["kernels"]["activation_bytes_total"] / max(limit["kernels"]["activation_bytes_total"], 1)
    return {
        "model": model_name,
        "batch": batch,
        "seq_len": seq_len,
        "steps": steps,
        "machine": machine_info(device),
        "variants": rows,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    rows = []
    for r in result["variants"]:
        k = r.get("kernels", {})
        st = r["step_seconds"]
        rows.append(
            [
                r["variant"],
                f"{st['median'] * 1e3:.1f} [{st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f}]",
                f"{r['tokens_per_second']:.0f}",
                f"{r.get('time_vs_inductor', float('nan')):.2f}",
                k.get("kernels", "-"),
                f"{k['kernels_touching_fp32_activations']} ({k['kernels_touching_fp32_per_token']})" if k else "-",
                _mib(k["activation_bytes_total"]) if k else "-",
                f"{r['activation_bytes_vs_limit']:.2f}" if "activation_bytes_vs_limit" in r else "-",
                f"{_mib(r['saved_for_backward_bytes_total'])} / {_mib(r['saved_activation_bytes_total'])}",
                f"{r.get('saved_bytes_vs_inductor', float('nan')):.2f} / {r.get('saved_activation_bytes_vs_inductor', float('nan')):.2f}",
                f"{r['compile_seconds']:.1f} ({(r['pass_share_of_compile'] or 0) * 100:.1f}%)" if "compile_seconds" in r else "-",
            ]
        )
    head = (
        f"{result['model']}, batch {result['batch']} x seq {result['seq_len']}, {result['steps']} timed steps on {m['device']}"
        f" ({m.get('gpu') or m.get('cpu', '?')}), torch {m['torch']}"
    )
    note = ""
    if m["device"] == "cpu":
        if m["cpu_native_bf16"]:
            native = f"this CPU has native bf16 instructions ({', '.join(f for f in m['cpu_bf16_flags'] if 'bf16' in f)}), but"
        else:
            native = "this CPU has NO native bf16 (no avx512_bf16 / amx_bf16): bf16 can run slower than fp32 here, and"
        note = (
            f"\nNOTE (CPU run): {native} Inductor's C++ kernels compute bf16 elementwise math through fp32 conversions,\n"
            "so time ratios here are not the GPU story; kernel counts, bytes by dtype and saved-for-backward bytes are."
        )
    table = tabulate(
        rows,
        headers=[
            "variant",
            "step ms median [min-max]",
            "tokens/s",
            "time vs inductor",
            "kernels",
            "fp32-stream kernels (any per-token)",
            "stream MiB (gen)",
            "stream vs bf16 limit",
            "saved MiB all / act",
            "saved vs inductor all / act",
            "compile s (pass %)",
        ],
    )
    extern = "\n".join(
        f"  {r['variant']}: extern calls {r['kernels']['extern_calls']}, bytes {r['kernels']['extern_bytes']}; "
        f"generated read {r['kernels']['bytes_read']}, written {r['kernels']['bytes_written']}"
        + (f"; expert GEMMs (grouped_mm) by dtype {r['kernels']['grouped_gemm_calls']}" if r["kernels"].get("grouped_gemm_calls") else "")
        for r in result["variants"]
        if "kernels" in r
    )
    return f"{head}{note}\n\n{table}\n\nkernel bytes by dtype (generated; extern matmuls/attention listed apart):\n{extern}"
