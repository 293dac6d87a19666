"""The engine contract without an engine: its ops, their gradients, the rewrites on every sweep architecture,
the row plans, and training under it. The live-engine tests are in tests/engine (the engine environment)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fx_precision as fxp
from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.batch_rows import check_logits_calls, row_plans
from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.ops import engine_attention, engine_linear, engine_rotary, engine_rows, variant_codes
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
VEC = AttentionArithmetic(scores="vec", exp="libm", reduce="avx2", p_bf16=False, fma=False, store="truncate")  # the AVX2 build's
PORTABLE = EngineContract(attention=VEC, rounding="truncate")  # runs on any x86 CPU: no AMX, no small-batch linears
NEAREST = EngineContract(attention=VEC, rounding="nearest-even")  # rotary written into the graph (truncation: an op)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    heads = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k.repeat_interleave(heads, 2), v.repeat_interleave(heads, 2)))
    return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None).transpose(1, 2)


def test_the_contract_round_trips_and_refuses_what_it_cannot_be() -> None:
    contract = PORTABLE.with_attention(exp="fast512")
    assert EngineContract.from_dict(json.loads(json.dumps(contract.to_dict()))) == contract
    with pytest.raises(PrecisionError, match="unknown field"):
        EngineContract.from_dict({**contract.to_dict(), "bogus": 1})
    with pytest.raises(PrecisionError, match=r"AttentionArithmetic\.scores='gpu'"):
        AttentionArithmetic(scores="gpu")
    with pytest.raises(PrecisionError, match="the engine runs bf16 weights and bf16 compute"):
        fxp.PrecisionPolicy(compute=BF16, gather=torch.float32, contract=contract)
    assert "truncate store" in contract.describe() and "batch-invariant linears" in contract.describe()


def test_vec_attention_is_fp32_attention_stored_once_and_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 37, 4, 32).to(BF16), torch.randn(3, 37, 2, 32).to(BF16), torch.randn(3, 37, 2, 32).to(BF16)
    out = engine_attention(q, k, v, torch.full((3,), 37), None, 32**-0.5, True, -1, 0, variant_codes(VEC))
    assert out.dtype == BF16 and (out.float() - _reference(q, k, v)).abs().max() < 2e-2
    alone = engine_attention(q[1:2], k[1:2], v[1:2], torch.tensor([37]), None, 32**-0.5, True, -1, 0, variant_codes(VEC))
    assert torch.equal(alone, out[1:2])  # a row of the batch is the row alone
    # a boolean mask (sliding window of 5) and the same mask given as window= agree bit for bit
    pos = torch.arange(37)
    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 5)
    by_mask = engine_attention(q, k, v, torch.full((3,), 37), window[None, None], 32**-0.5, False, -1, 0, variant_codes(VEC))
    by_window = engine_attention(q, k, v, torch.full((3,), 37), None, 32**-0.5, True, 4, 0, variant_codes(VEC))
    assert torch.equal(by_mask, by_window)
    truncated = by_mask.float().view(torch.int32) & 0xFFFF  # the store truncates: bf16 from the fp32 high half
    assert int(truncated.abs().sum()) == 0


def test_amx_attention_runs_the_hardware_instruction_or_says_it_cannot() -> None:
    q, k, v = (torch.randn(1, 40, 2, 32).to(BF16) for _ in range(3))
    codes = variant_codes(AttentionArithmetic())
    if not engine_kernels().cpu_has_amx():
        with pytest.raises(PrecisionError, match="this CPU has no AMX"):
            engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, codes)
        return
    out = engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, codes)
    again = engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, codes)
    assert torch.equal(out, again) and (out.float() - _reference(q, k, v)).abs().max() < 2e-2


def test_amx_attention_16_rows_per_tile_is_the_one_row_reference_bit_for_bit() -> None:
    """The AMX kernel runs 16 query rows per tile (keys a row does not see enter with p = 0); every row must be
    the bits of the one-row reference, the engine's order, on every mask form: causal, window, padding, boolean
    masks per head, decode offsets, GQA, head dims of 32 to 128, and scores large enough to underflow exp."""
    from fx_precision.contract.ops import _require_amx

    if not engine_kernels().cpu_has_amx():
        with pytest.raises(PrecisionError, match="this CPU has no AMX"):
            _require_amx()
        return
    _require_amx()
    torch.manual_seed(6)
    cases = [  # (B, T, S, H, KVH, D, causal, window, q_offset, mask heads or 0, key lengths or None, score scale)
        (2, 150, 150, 4, 2, 32, True, -1, 0, 0, None, 1.0), (1, 45, 45, 4, 4, 128, True, -1, 0, 0, None, 1.0),
        (3, 37, 37, 8, 2, 64, True, -1, 0, 0, None, 1.0), (2, 5, 100, 4, 2, 64, True, -1, 95, 0, None, 1.0),
        (2, 70, 70, 4, 2, 32, True, 20, 0, 0, None, 1.0), (2, 70, 70, 4, 2, 32, False, -1, 0, 0, None, 1.0),
        (2, 70, 70, 4, 2, 32, True, -1, 0, 0, [70, 33], 1.0), (2, 70, 70, 4, 2, 32, True, -1, 0, 1, None, 1.0),
        (2, 70, 70, 4, 2, 32, False, -1, 0, 4, None, 1.0), (2, 64, 64, 4, 2, 32, True, -1, 0, 0, None, 30.0),
    ]  # fmt: skip
    for B, T, S, H, KVH, D, causal, window, offset, mask_heads, lens, spread in cases:
        q, k = (torch.randn(B, T, H, D) * spread).to(BF16), (torch.randn(B, S, KVH, D) * spread).to(BF16)
        v = torch.randn(B, S, KVH, D).to(BF16)
        key_lens = torch.tensor(lens) if lens else torch.full((B,), S)
        mask = torch.rand(B, mask_heads, T, S) > 0.3 if mask_heads else None
        for arithmetic in (AttentionArithmetic(), AttentionArithmetic(exp="libm", reduce="avx2", store="truncate")):
            args = (q, k, v, key_lens, mask, D**-0.5, causal, window, offset, variant_codes(arithmetic))
            tiled, rowwise = engine_kernels().attention(*args), engine_kernels().attention(*args, rowwise=True)
            assert torch.equal(tiled.view(torch.int16), rowwise.view(torch.int16)), (B, T, S, H, KVH, D, causal, window, offset, arithmetic)


def test_a_mask_that_is_the_causal_range_runs_as_the_range() -> None:
    """transformers hands sdpa its causal mask as a tensor: the op runs it as causal=True with no mask (the same
    keys, no per-key reads), and keeps any mask that blocks more, row by row."""
    from fx_precision.contract.ops import _mask_as_range

    T = S = 6
    causal = torch.ones(T, S, dtype=torch.bool).tril()[None, None].expand(2, 1, T, S)
    full = torch.tensor([6, 6])
    assert _mask_as_range(causal, full, False, -1, 0) == (None, True)
    assert _mask_as_range(causal, full, True, -1, 0) == (None, True)
    assert _mask_as_range(torch.ones(2, 1, T, S, dtype=torch.bool), full, True, -1, 0) == (None, True)  # adds nothing
    padded = causal.clone()
    padded[1, :, :, 4:] = False  # keys past row 1's length are blocked by key_lens anyway
    assert _mask_as_range(padded, torch.tensor([6, 4]), False, -1, 0) == (None, True)
    holed = causal.clone()
    holed[0, 0, 5, 2] = False
    kept, is_causal = _mask_as_range(holed, full, False, -1, 0)
    assert kept is holed and is_causal is False
    q, k, v = (torch.randn(2, T, 2, 32).to(BF16) for _ in range(3))
    codes = variant_codes(VEC)
    by_mask = engine_attention(q, k, v, full, holed, 32**-0.5, False, -1, 0, codes)
    assert torch.equal(by_mask[1], engine_attention(q, k, v, full, None, 32**-0.5, True, -1, 0, codes)[1])
    assert not torch.equal(by_mask[0, 5], engine_attention(q, k, v, full, None, 32**-0.5, True, -1, 0, codes)[0, 5])


def test_attention_gradients_are_fp32_attention_gradients() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 9, 4, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    kk, vv = k[:, :, :2], v[:, :, :2]  # grouped-query: 4 query heads on 2 key/value heads
    out = engine_attention(q, kk, vv, torch.full((2,), 9), None, 32**-0.5, True, -1, 0, variant_codes(VEC))
    grads = torch.autograd.grad((out * torch.arange(out.numel()).view(out.shape).sin()).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _reference(q2.to(BF16).float(), k2[:, :, :2].to(BF16).float(), v2[:, :, :2].to(BF16).float())
    want = torch.autograd.grad((ref * torch.arange(ref.numel()).view(ref.shape).sin()).sum(), (q2, k2, v2))
    for got, expected in zip(grads, want, strict=True):
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_rotary_is_fp32_math_one_store_and_straight_through_in_backward() -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 4, 11, 32).to(BF16).requires_grad_()
    angle = torch.randn(11, 16)
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(BF16)[None, None]
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(BF16)[None, None]
    x1, x2 = x.detach()[..., :16].float(), x.detach()[..., 16:].float()
    c, s = cos[..., :16].float(), sin[..., :16].float()
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    assert torch.equal(engine_rotary(x, cos, sin, 0), exact.to(BF16))
    truncated = engine_rotary(x, cos, sin, 1)
    assert torch.equal(truncated, (exact.view(torch.int32) & -65536).view(torch.float32).to(BF16))
    (grad,) = torch.autograd.grad(engine_rotary(x, cos, sin, 1).float().sum(), x)
    xf = x.detach().float().requires_grad_()
    xa, xb = xf[..., :16], xf[..., 16:]
    (want,) = torch.autograd.grad(torch.cat((xa * c - xb * s, xb * c + xa * s), -1).sum(), xf)
    assert torch.equal(grad.float(), want.to(BF16).float())  # the rotation's gradient: rounding passed straight through


def test_rsqrt_under_inductor_is_torch_rsqrt_bit_for_bit() -> None:
    """The contract leaves a norm's rsqrt to Inductor: its code and torch's eager kernel are both IEEE 1 / sqrt(x),
    vector body and scalar tail. Values across the fp32 range (subnormal to huge), a length with a tail."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(7)
    x = torch.cat((torch.rand(100_003) * 10.0 ** torch.randint(-40, 38, (100_003,)).float(), torch.tensor([1e-45, 3.4e38, 1.0])))
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(lambda t: torch.rsqrt(t + 1e-6), backend="inductor")(x)
    assert torch.equal(compiled.view(torch.int32), torch.rsqrt(x + 1e-6).view(torch.int32))


def test_the_rotation_in_the_graph_is_the_engine_kernel_under_inductor() -> None:
    """With a nearest-even store the rotary rewrite writes the rotation into the graph (fp32 from bf16 operands,
    one store), so Inductor fuses it with its neighbours: it must still be the kernel's bits, with cos / sin
    given in fp32 or bf16, and the coverage check must not take the written rotation for an unfollowed one."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from fx_precision.passes.rewrites.engine import engine_coverage
    from fx_precision.passes.rewrites.engine import engine_rotary as rotary_rewrite

    def rotate_half(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), dim=-1)

    def model(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q = (x @ w).to(BF16)
        return (q * cos.to(BF16) + rotate_half(q) * sin.to(BF16)) * 2

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        rewritten.append(len(rotary_rewrite(NEAREST)(gm, None)))  # type: ignore[arg-type]
        engine_coverage(NEAREST)(gm, None)  # type: ignore[arg-type]
        return compile_fx(gm, example_inputs)

    torch.manual_seed(8)
    x, w = torch.randn(2, 4, 19, 64).to(BF16), (torch.randn(64, 64) * 0.2).to(BF16)
    angle = torch.arange(19).float()[:, None] * torch.logspace(0, -4, 32)[None]
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    for table in ((cos, sin), (cos.to(BF16), sin.to(BF16))):
        rewritten: list[int] = []
        torch._dynamo.reset()
        with inductor_config.patch(emulate_precision_casts=True):
            got = torch.compile(model, backend=backend)(x, *table, w)
        want = engine_rotary((x @ w).to(BF16), table[0].to(BF16), table[1].to(BF16), 0) * 2
        assert rewritten == [1] and torch.equal(got, want)


def test_the_linear_follows_the_row_plan() -> None:
    torch.manual_seed(3)
    x, w, b = torch.randn(1, 6, 64).to(BF16), (torch.randn(32, 64) * 0.1).to(BF16), torch.randn(32).to(BF16)
    batched = torch.nn.functional.linear(x, w, b)
    assert torch.equal(engine_linear(x, w, b, 0), batched)  # no plan: the batched kernel, torch's
    flags = torch.tensor([[False, True, False, False, True, False]])
    if not engine_kernels().cpu_has_avx512_bf16():
        with pytest.raises(PrecisionError, match="AVX-512 BF16"), engine_rows(flags, None):
            engine_linear(x, w, b, 0)
        return
    with engine_rows(flags, None):
        mixed = engine_linear(x, w, b, 0)
        logits_kind = engine_linear(x, w, b, 1)  # the logits plan is unset: all batched
    assert torch.equal(mixed[0, ~flags[0]], batched[0, ~flags[0]]) and torch.equal(logits_kind, batched)
    assert (mixed.float() - batched.float()).abs().max() <= 0.02 * batched.float().abs().max()


def test_row_plans_follow_the_engine_steps() -> None:
    # two prompts of 6 and 3 tokens prefilled together (9 rows), then 2 decode steps of 2 rows; b's
    # decode row (3, 4) repeats a row of a's prefill: rows are claimed in order, each once
    a, b = SimpleNamespace(tokens=(1, 2, 3, 4, 5, 6, 9, 8), prompt_len=6), SimpleNamespace(tokens=(7, 6, 5, 4, 3), prompt_len=3)
    prefill = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (0, 7), (1, 6), (2, 5)]
    steps = [prefill, [(6, 9), (3, 4)], [(7, 8), (4, 3)]]
    engine = {"steps": steps, "logits_calls": [[0, 2], [0, 5], [0, 2], [1, 2], [2, 2]]}
    plan_a, plan_b = row_plans([a, b], engine, 4)
    assert plan_a.body == (False,) * 6 + (True, True) and plan_b.body == (False,) * 3 + (True, True)
    assert plan_a.logits == (False,) * 5 + (True, True)  # prompt log-probs in a call of 5 rows; then sampling, 2 per call
    assert plan_b.logits == (True, True, True, True)  # a prompt-log-prob call of 2 rows: small too
    assert check_logits_calls([a, b], engine) is None
    assert "other batches" in (check_logits_calls([a, b], {**engine, "logits_calls": [[0, 9]]}) or "")


def _rms_rotary_mlp(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A norm's mean of squares, a rotary table, an activation and a layer norm: what an engine runs eagerly."""
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16) * w
    angles = pos[:, None] * (1.0 / 1e6 ** (torch.arange(0, 32, 2).float() / 32))[None]
    table = torch.cat((angles.cos(), angles.sin()), -1).to(BF16)
    layer_normed = torch.nn.functional.layer_norm(h, (h.shape[-1],), w.float(), None, 1e-5)
    return normed, table, torch.nn.functional.silu(normed) * normed, layer_normed


def test_eager_math_keeps_torch_kernels_under_inductor() -> None:
    """Inductor sums a mean of squares in another order and approximates cos / sin / exp otherwise than
    torch's eager kernels (an fp32 ulp on 10-30% of values): at the 4096 rows here some bf16 roundings flip.
    With the contract's eager-math rewrite the compiled graph is bitwise the eager one, and gradients flow."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from fx_precision.passes.rewrites.engine import engine_eager_math

    torch.manual_seed(5)
    x, w, pos = (torch.randn(4096, 128) * 3).to(BF16), (torch.randn(128) * 0.1 + 1).to(BF16), torch.arange(4096).float()
    want = _rms_rotary_mlp(x, w, pos)
    rewritten: list[int] = []

    def backend(rewrite: bool):  # type: ignore[no-untyped-def]
        def compile_with(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
            if rewrite:
                rewritten.append(len(engine_eager_math(gm, None)))  # type: ignore[arg-type]
            return compile_fx(gm, example_inputs)

        return compile_with

    with inductor_config.patch(emulate_precision_casts=True):
        torch._dynamo.reset()
        plain = torch.compile(_rms_rotary_mlp, backend=backend(False))(x, w, pos)
        torch._dynamo.reset()
        kept = torch.compile(_rms_rotary_mlp, backend=backend(True))(x, w, pos)
    assert not all(torch.equal(a, b) for a, b in zip(plain, want, strict=True))  # Inductor's own math parts somewhere
    assert all(torch.equal(a, b) for a, b in zip(kept, want, strict=True))
    assert rewritten == [5]  # mean, cos, sin, silu, layer_norm; pow(x, 2) is x * x and rsqrt 1 / sqrt(x) in both: they stay
    xg = x.float().requires_grad_()
    torch._dynamo.reset()
    out = torch.compile(_rms_rotary_mlp, backend=backend(True))(xg, w, pos)
    (grad,) = torch.autograd.grad(out[3].sum() + out[2].float().sum(), xg)
    xe = x.float().requires_grad_()
    ref = _rms_rotary_mlp(xe, w, pos)
    (expected,) = torch.autograd.grad(ref[3].sum() + ref[2].float().sum(), xe)
    assert float((grad - expected).norm() / expected.norm()) < 1e-2  # bf16 rounding level: the backward is Inductor's


@pytest.mark.needs_transformers
def test_the_rewrites_are_found_on_every_architecture_of_the_sweep(request: pytest.FixtureRequest) -> None:
    """Found by what the ops do: on every zoo architecture each pattern it has is rewritten, or the contract
    refuses the graph and names what it does not follow (eager softmax attention, interleaved or written-out rotary).
    The default run takes one architecture per family (the sweep's FAST, and one per refusal); --slow the whole zoo."""
    from fx_precision.passes.analysis import copy_graph_module
    from fx_precision.passes.capture import capture_graphs
    from fx_precision.passes.context import Mode, PassContext
    from fx_precision.passes.graph.units import UnitIndex
    from fx_precision.passes.pipeline import run_pipeline
    from fx_precision.passes.rewrites.engine import engine_rewrites
    from fx_precision.tools.arch_zoo import ARCHS
    from tests.arch_subsets import FAST

    found: dict[str, dict[str, int]] = {}
    refused: dict[str, str] = {}
    chosen = {a.name for a in ARCHS} if request.config.getoption("--slow") else {*FAST, "bloom", "cohere", "qwen3-moe"}
    for spec in (a for a in ARCHS if a.name in chosen):
        model = spec.build().to(BF16)
        ids = torch.randint(0, 256, (1, 8))
        captured, names = capture_graphs(
            model, (), {"input_ids": ids}, dynamic=False, device_type="cpu", autocast=torch.autocast("cpu", BF16)
        )
        counts: dict[str, int] = {}
        try:
            for i, cap in enumerate(captured):
                ctx = PassContext(BF16, "cpu", UnitIndex(), cap.example_inputs, names, i)
                result = run_pipeline(copy_graph_module(cap.gm), ctx, Mode.CASTS, engine_rewrites(NEAREST))
                for name, done in result.rewrites.items():
                    counts[name] = counts.get(name, 0) + len(done)
        except PrecisionError as e:
            refused[spec.name] = str(e)
            continue
        found[spec.name] = counts
        layers = model.config.num_hidden_layers
        attention_layers = sum(
            hasattr(m, "q_proj") or hasattr(m, "query_key_value") or hasattr(m, "c_attn") or hasattr(m, "qkv_proj") for m in model.modules()
        )
        has_rope = any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules())
        if "llama-norm" in spec.patterns or "gemma-norm" in spec.patterns:
            assert counts.get("fused-add-norm", 0) == 2 * layers, (spec.name, counts)  # every norm after a residual add
        if has_rope:
            assert counts.get("engine-rotary", 0) == 2 * attention_layers, (spec.name, attention_layers, counts)  # q and k
        assert counts.get("engine-attention", 0) == attention_layers, (spec.name, attention_layers, counts)
        norms = sum(type(m).__name__.endswith(("RMSNorm", "LayerNorm", "Norm")) for m in model.modules())
        assert counts.get("engine-eager-math", 0) >= norms, (spec.name, norms, counts)  # each norm's reduction kept eager
    moe = {"qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3", "qwen3-next"}
    assert set(refused) == ({"gemma2", "bloom", "cohere", "qwen3.5"} | moe) & chosen, sorted(refused)
    assert "matmul + softmax at model.layers.0.self_attn" in refused["gemma2"]  # soft-capping runs eager attention
    assert "matmul + softmax at transformer.h.0.self_attention" in refused["bloom"]  # ALiBi
    assert "rotary the contract does not follow" in refused["cohere"] and "rotate_half" in refused["cohere"]  # interleaved
    assert "rotary the contract does not follow" in refused["deepseek-v3"]  # MLA's written-out interleaved rotation
    assert "mixture-of-experts routing (topk) at model.layers.0.mlp" in refused["qwen3-moe"]
    assert "causal convolution (a linear-attention layer) at model.layers.0.linear_attn" in refused["qwen3.5"]


@pytest.mark.needs_transformers
def test_rollout_without_the_engine_is_one_line_naming_the_engine_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fx_precision.tools.checkpoint import write_tiny_checkpoint
    from fx_precision.tools.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # as in the main environment: `import vllm` raises ImportError
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    assert main(["rollout", "--model", str(checkpoint), "--prompt-lens", "5,9", "--out", str(tmp_path / "dump")]) == 2
    err = capsys.readouterr().err
    assert "the vllm engine is not installed" in err and "fx_precision.tools.engine_env" in err and "Traceback" not in err
    assert not (tmp_path / "dump").exists()


@pytest.mark.needs_transformers
def test_training_under_the_contract_on_two_gloo_ranks() -> None:
    """FSDP2 on 2 gloo ranks, compiled whole with the contract's rewrites: the loss falls, masters and their
    gradients stay fp32, and the first step's gradients are within 5% (relative L2, every parameter) of the
    same run without the contract (plain bf16 gather and autocast): the rewrites change roundings, not the model.
    Measured on tiny Qwen3 (torch 2.13.0+cpu, Sapphire Rapids): worst 1.7e-2 (a k_norm weight), median 8.9e-3,
    the bf16 rounding level; losses over 4 steps agree to 1e-3."""
    from fx_precision.tools.distributed import run_on_ranks
    from tests import fsdp_workers

    runs = [("contract_training", ("qwen3", PORTABLE.to_dict(), 4)), ("contract_training", ("qwen3", None, 1))]
    ((under, plain),) = [r for r in run_on_ranks(fsdp_workers.in_turn, 2, runs) if r]
    # one decoder-layer graph serves every layer (the same code, compiled once); FSDP2 units break the graph between
    # layers, so the fused add + norm is kept across the break (the sum leaving one graph, taken by the next one's norm)
    # eager math: the layer graph's 4 norms' means and silu, the final norm's, the rotary table's cos and sin
    rewrites = {"fused-add-norm": 4, "engine-rotary": 2, "engine-attention": 1, "engine-eager-math": 8, "engine-coverage": 0}
    assert under["rewrites"] == rewrites, under
    assert under["losses"][-1] < under["losses"][0], under["losses"]
    assert set(under["master_dtypes"].values()) == {torch.float32} and set(under["grad_dtypes"].values()) == {torch.float32}
    worst = max(float((under["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in plain["grads"].items())
    assert worst < 5e-2, worst


@pytest.mark.needs_transformers
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_the_linear_probe_finds_fused_projections_stored_split_or_fused(arch: str, tmp_path: Path) -> None:
    """The engine fuses q/k/v and gate/up; a checkpoint stores them split (Llama) or fused (Phi-3). Either way the
    probe must find the engine's fused weight, or the decode steps' small-batch kernel goes unfollowed on that shape."""
    from safetensors.torch import load_file

    from fx_precision.contract.probe import checkpoint_weights
    from fx_precision.tools.checkpoint import write_tiny_checkpoint

    directory = write_tiny_checkpoint(arch, tmp_path / arch)
    stored = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    lookup = checkpoint_weights(str(directory))
    qkv, _ = lookup("model.layers.0.self_attn.qkv_proj")
    gate_up, _ = lookup("model.layers.0.mlp.gate_up_proj")
    if arch == "phi3":
        assert torch.equal(qkv, stored["model.layers.0.self_attn.qkv_proj.weight"])
        assert torch.equal(gate_up, stored["model.layers.0.mlp.gate_up_proj.weight"])
    else:
        parts = [stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert torch.equal(qkv, torch.cat(parts)) and gate_up.shape[0] == 2 * stored["model.layers.0.mlp.up_proj.weight"].shape[0]
    assert lookup("model.layers.0.self_attn.nothing") is None
