"""The contract against a compiled engine, without an engine: vLLM at its defaults compiles its model's native forms
with Inductor, and the contract gives the training side's Inductor the same graph.

    a transformers-style block under the inductor forms, compiled      ==  vLLM's native forms compiled by Inductor
    the same block without them, compiled                              !=  (the engine's fp32 stream and fused stores)
    fxp_engine.stored keeps a rounding Inductor drops from a plain cast
    the contract carries the engine's Inductor build; another build, or an eager training side, is refused in one line

The reference below is vLLM 0.32's own native code (vllm/ir/ops/layernorm.py rms_norm / fused_add_rms_norm,
rotary_embedding/common.py forward_static, activation.py SiluAndMul.forward_native), written out here because vLLM
is not installed in this environment; tests/engine checks the live engine.
"""

from __future__ import annotations

import pytest
import torch

from fx_precision.contract import EngineContract, RotaryOp
from fx_precision.contract.inductor_build import inductor_build
from fx_precision.contract.linear_order import LinearCall, LinearOrder, LinearOrders
from fx_precision.contract.vocabulary import NormForm, RotaryForm
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
HEADS, HEAD_DIM, HIDDEN = 4, 32, 128


@torch.library.custom_op("fxp_test::gemm", mutates_args=())
def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A GEMM outside Inductor's graph (the engine's oneDNN call): bf16 in (a wider x rounded first, as the contract's
    linear takes it), bf16 out."""
    return (x.to(BF16).float() @ w.float().t()).to(BF16)


@gemm.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=BF16)


def _compiled_contract() -> EngineContract:
    orders = LinearOrders(1, (LinearCall(64, 32, 8, LinearOrder.sequential(32)),))  # rewrites need orders; never run here
    return EngineContract(norm=NormForm.INDUCTOR, rotary=RotaryOp(RotaryForm.INDUCTOR, None), linears=orders, inductor=inductor_build())


# --- vLLM's native forms (module docstring) ----------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def _fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + x_residual.to(torch.float32)
    x_residual = x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), x_residual


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _vllm_layer(emb: torch.Tensor, w: dict[str, torch.Tensor], cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Two decoder layers as vLLM's Qwen3 runs them (rows flat; attention left out: its op is the contract's own)."""
    residual, hidden = None, emb
    cos, sin = cos_sin.index_select(0, positions).chunk(2, dim=-1)
    for layer in range(2):
        if residual is None:
            residual, hidden = hidden, _rms_norm(hidden, w[f"in{layer}"])
        else:
            hidden, residual = _fused_add_rms_norm(hidden, residual, w[f"in{layer}"])
        q = _rms_norm(gemm(hidden, w["q"]).view(-1, HEADS, HEAD_DIM), w[f"q_norm{layer}"])
        hidden = gemm(_rotary(q, cos, sin).view(-1, HIDDEN), w["o"])
        hidden, residual = _fused_add_rms_norm(hidden, residual, w[f"post{layer}"])
        gate_up = gemm(hidden, torch.cat((w["gate"], w["up"])))
        d = gate_up.shape[-1] // 2
        hidden = gemm(torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:], w["down"])
    hidden, _ = _fused_add_rms_norm(hidden, residual, w["final"])
    return hidden


# --- the same model as transformers writes it ----------------------------------------------------------------------


def _tf_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + 1e-6)
    return weight * h.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _tf_block(hidden: torch.Tensor, layer: int, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    residual = hidden
    hidden = _tf_rms(hidden, w[f"in{layer}"])
    q = _tf_rms(gemm(hidden, w["q"]).view(-1, HEADS, HEAD_DIM), w[f"q_norm{layer}"])
    q = q * cos + _rotate_half(q) * sin
    hidden = residual + gemm(q.reshape(-1, HIDDEN), w["o"])
    residual = hidden
    hidden = _tf_rms(hidden, w[f"post{layer}"])
    return residual + gemm(torch.nn.functional.silu(gemm(hidden, w["gate"])) * gemm(hidden, w["up"]), w["down"])


def _tf_layer(emb: torch.Tensor, w: dict[str, torch.Tensor], inv_freq: torch.Tensor, positions: torch.Tensor,
              units: bool = False) -> torch.Tensor:  # fmt: skip
    """``units``: a graph break after the tables and after each layer (as FSDP2's unit hooks break a compiled model)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    table = torch.cat((freqs, freqs), dim=-1)
    cos, sin = table.cos().to(BF16)[:, None, :], table.sin().to(BF16)[:, None, :]
    if not units:
        hidden = _tf_block(_tf_block(emb, 0, w, cos, sin), 1, w, cos, sin)
        return _tf_rms(hidden, w["final"])
    torch._dynamo.graph_break()
    hidden = _tf_block(emb, 0, w, cos, sin)
    torch._dynamo.graph_break()
    hidden = _tf_block(hidden, 1, w, cos, sin)
    torch._dynamo.graph_break()
    return _tf_rms(hidden, w["final"])


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale + offset).to(BF16)

    w = {name: rand(HIDDEN, offset=1.0, scale=0.1) for name in ("in0", "in1", "post0", "post1", "final")}
    w |= {"q_norm0": rand(HEAD_DIM, offset=1.0, scale=0.1), "q_norm1": rand(HEAD_DIM, offset=1.0, scale=0.1)}
    w |= {"q": rand(HIDDEN, HIDDEN), "o": rand(HIDDEN, HIDDEN)}
    return w | {"gate": rand(256, HIDDEN), "up": rand(256, HIDDEN), "down": rand(HIDDEN, 256)}


def _tf_compiled(rewrite: bool, contract: EngineContract | None = None):  # type: ignore[no-untyped-def]
    from torch._inductor.compile_fx import compile_fx

    from fx_precision.passes.rewrites.engine import fuse_add_norm
    from fx_precision.passes.rewrites.engine.eager_math import engine_eager_math
    from fx_precision.passes.rewrites.engine.rotary import engine_rotary

    contract = contract or _compiled_contract()

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        if rewrite:
            for step in (engine_eager_math(contract), fuse_add_norm(contract), engine_rotary(contract)):
                done.append(len(step(gm, None)))  # type: ignore[arg-type]
        return compile_fx(gm, example_inputs)

    done: list[int] = []
    torch._dynamo.reset()
    return torch.compile(_tf_layer, backend=backend), done


def test_the_inductor_forms_compile_to_what_the_engines_native_forms_compile_to() -> None:
    """Held on rows of prompt lengths no GEMM row count repeats; the engine's tables in bf16 as vLLM keeps them."""
    import fx_precision.contract.ops  # noqa: F401  (fxp_engine.stored)

    w = _weights(3)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    for rows in (37, 301):
        emb = (torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)) * 0.5).to(BF16)
        positions = torch.arange(rows)
        freqs = torch.einsum("i,j -> ij", torch.arange(512).float(), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(BF16)  # vLLM's cache, computed eagerly at load
        torch._dynamo.reset()
        engine = torch.compile(_vllm_layer, backend="inductor", dynamic=True)(emb, w, cos_sin, positions)
        followed, rewrites = _tf_compiled(rewrite=True)
        plain, _ = _tf_compiled(rewrite=False)
        got, as_is = followed(emb, w, inv_freq, positions), plain(emb, w, inv_freq, positions)
        assert rewrites == [2, 11, 2]  # cos and sin eager; 4 residual adds and 7 norms; q in each layer rotated
        assert torch.equal(got, engine), f"{rows} rows: {int((got != engine).sum())} of {got.numel()} differ"
        assert not torch.equal(as_is, engine)  # without the forms the training side computes otherwise


def test_stored_keeps_the_rounding_a_plain_cast_loses_in_a_fused_kernel() -> None:
    """``x.to(bf16).float() * y`` in one Inductor kernel multiplies the unrounded x; behind fxp_engine.stored the bf16
    value is what is multiplied, and the gradient passes straight through."""
    import fx_precision.contract.ops  # noqa: F401

    x = torch.randn(4096, dtype=torch.float32) * 3 + 0.001
    y = torch.randn(4096)
    torch._dynamo.reset()
    plain = torch.compile(lambda a, b: a.to(BF16).float() * b, backend="inductor")(x, y)
    torch._dynamo.reset()
    kept = torch.compile(lambda a, b: torch.ops.fxp_engine.stored(a, BF16).float() * b, backend="inductor")(x, y)
    assert torch.equal(kept, x.to(BF16).float() * y)
    assert not torch.equal(plain, kept)  # what the op is for: Inductor dropped the plain cast's rounding
    xg = x.clone().requires_grad_()
    torch.ops.fxp_engine.stored(xg, BF16).float().sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, torch.ones_like(x))


def test_the_contract_carries_the_engines_inductor_and_is_refused_elsewhere() -> None:
    from fx_precision.backend import check_compiled_engine

    contract = _compiled_contract()
    assert EngineContract.from_dict(contract.to_dict()) == contract and "compiled by Inductor" in contract.describe()
    old = contract.to_dict()
    del old["inductor"]
    assert EngineContract.from_dict(old).inductor is None  # a dump of the eager engine, written before: read as such
    check_compiled_engine(inductor_build(), "inductor")
    with pytest.raises(PrecisionError, match="--compiled"):
        check_compiled_engine(inductor_build(), "aot_eager")
    with pytest.raises(PrecisionError, match="FSDP2"):
        check_compiled_engine(inductor_build(), "inductor", world_size=2)
    with pytest.raises(PrecisionError, match="the engine's torch build"):
        check_compiled_engine("torch 0.0.0, avx2, simdlen None, fp-contract off", "inductor")
    with pytest.raises(PrecisionError, match=r"EngineContract\.inductor"):
        EngineContract(inductor="")
