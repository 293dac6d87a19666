"""GatedDeltaNet under the engine contract (contract/gdn.py, passes/rewrites/engine/gdn.py); the kernels' bits against
vLLM's own are held in the engine suite (tests/engine/test_gdn.py).

the ops          the engine-form forward (bf16 pieces, chunks of 64, the decode recurrence) stays within bf16
                 rounding of the fp32 reference, whatever the split into pieces and decoded rows; the reference is the
                 model's own delta rule (transformers' torch_chunk_gated_delta_rule); a row the engine never computed
                 is zero; bad plans and head dims the engine's kernel refuses are one-line errors
the rewrite      a transformers Qwen3.5 (split projections) and a Qwen3-Next (fused in_proj_qkvz / in_proj_ba),
                 compiled under a contract with a GatedDeltaNet form, compute each linear-attention layer with one
                 fxp_engine.gdn and one fxp_engine.gated_rms_norm, their logits stay within bf16 rounding of the
                 model's own, and every GDN parameter gets a finite gradient close to the model's own
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fx_precision as fxp
from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.batch_rows import GDN_DECODE, GDN_NONE, EngineRows, engine_rows
from fx_precision.contract.gdn import GdnLayer, engine_gdn, gdn_forward, gdn_reference
from fx_precision.contract.gdn_form import PORTABLE, GdnForm
from fx_precision.contract.linear_order import LinearOrders, candidate_orders
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
VEC = AttentionArithmetic(scores="vec", exp="libm", reduce="avx2", p_bf16=False, fma=False, store="truncate")


def _layer_inputs(T: int, H: int, Hv: int, D: int, K: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    C = 2 * H * D + Hv * D
    x = torch.randn(1, C, T, generator=g).to(BF16)
    weight = (torch.randn(C, 1, K, generator=g) * 0.4).to(BF16)
    a, b = (torch.randn(1, T, Hv, generator=g) * 2).to(BF16), torch.randn(1, T, Hv, generator=g).to(BF16)
    A_log, dt_bias = torch.rand(Hv, generator=g) * 2, torch.randn(Hv, generator=g) * 0.5
    return x, weight, a, b, A_log, dt_bias


def _plan(*runs: tuple[str, int]) -> torch.Tensor:
    codes: list[int] = []
    for kind, n in runs:
        start = len(codes)
        codes += [start] * n if kind == "prefill" else [GDN_DECODE if kind == "decode" else GDN_NONE] * n
    return torch.tensor([codes], dtype=torch.int32)


@pytest.mark.parametrize(("H", "Hv", "D", "K"), [(2, 4, 64, 4), (1, 3, 128, 4), (2, 2, 64, 3)])
@pytest.mark.parametrize("state_bf16", [False, True])
def test_every_split_of_the_rows_stays_the_delta_rule(H: int, Hv: int, D: int, K: int, state_bf16: bool) -> None:
    """One piece, pieces across a chunk boundary, a one-token first piece, pieces then decoded rows: every split the
    engine may run gives the reference's values within bf16 rounding (a bf16 state a little further)."""
    T = 150
    x, weight, a, b, A_log, dt_bias = _layer_inputs(T, H, Hv, D, K, seed=H * 100 + D + K)
    want = gdn_reference(x, weight, a, b, A_log, dt_bias, H, 1e-5)
    tol = 0.08 if state_bf16 else 0.03
    splits = {
        "one piece": _plan(("prefill", T)),
        "pieces": _plan(("prefill", 70), ("prefill", 65), ("prefill", 15)),
        "one token first": _plan(("prefill", 1), ("prefill", T - 1)),
        "prefill then decode": _plan(("prefill", 100), ("decode", 50)),
        "decode after every piece": _plan(("prefill", 40), ("decode", 3), ("prefill", 60), ("decode", 47)),
    }
    results = {}
    for name, plan in splits.items():
        got = gdn_forward(x, a, b, plan, GdnLayer(weight, A_log, dt_bias, H, state_bf16, 1e-5))
        assert got.dtype == BF16 and got.shape == want.shape
        err = (got.float() - want).abs().max().item()
        assert err < tol * max(1.0, want.abs().max().item()), f"{name}: max |delta| {err}"
        results[name] = got
    assert not torch.equal(results["one piece"], results["prefill then decode"])  # the decode kernel is its own arithmetic


@pytest.mark.skipif(not torch.cpu._is_avx512_supported(), reason="the AVX-512 build's kernels call this CPU's VRCP14PS: no AVX-512 here")
@pytest.mark.parametrize(("H", "Hv", "D"), [(2, 4, 64), (1, 32, 128)])
def test_the_avx512_builds_kernels_stay_the_delta_rule_at_every_split(H: int, Hv: int, D: int) -> None:
    """The engine's AVX-512 build (its exp_u20, VRCP14PS sigmoid and silu, brgemm order; 32 value heads: the gating's
    vector blocks) through every split gives the reference's values within bf16 rounding; its bits are the engine's own
    (tests/engine/test_gdn.py holds them to vLLM's binary)."""
    T = 150
    x, weight, a, b, A_log, dt_bias = _layer_inputs(T, H, Hv, D, 4, seed=H * 100 + D)
    want = gdn_reference(x, weight, a, b, A_log, dt_bias, H, 1e-5)
    layer = GdnLayer(weight, A_log, dt_bias, H, False, 1e-5, "avx512")
    results = {}
    splits = {"one piece": _plan(("prefill", T)), "prefill then decode": _plan(("prefill", 100), ("decode", 50)),
              "decode after every piece": _plan(("prefill", 40), ("decode", 3), ("prefill", 60), ("decode", 47))}  # fmt: skip
    for name, plan in splits.items():
        got = gdn_forward(x, a, b, plan, layer)
        err = (got.float() - want).abs().max().item()
        assert got.dtype == BF16 and err < 0.03 * max(1.0, want.abs().max().item()), f"{name}: max |delta| {err}"
        results[name] = got
    portable = gdn_forward(x, a, b, _plan(("prefill", T)), GdnLayer(weight, A_log, dt_bias, H, False, 1e-5))
    assert not torch.equal(results["one piece"], portable)  # another build, other bits
    with pytest.raises(PrecisionError, match=r"AVX-512 build.*fp32 state and conv width 4"):
        gdn_forward(x, a, b, _plan(("prefill", T)), GdnLayer(weight, A_log, dt_bias, H, True, 1e-5, "avx512"))


def test_the_avx512_builds_generic_code_parts_from_the_portable_one_in_its_decode_only() -> None:
    """vLLM's _C_AVX512 runs the portable build's generic GDN code compiled with the decode recurrence's multiply-adds
    fused (``portable-fma``): its prefilled pieces give the portable bits (the other fused products are two bf16 values,
    exact in fp32), its decoded rows other bits, still the delta rule's values (within bf16 rounding of the portable)."""
    from fx_precision.contract.gdn import decode_rule, gating

    x, weight, a, b, A_log, dt_bias = _layer_inputs(90, 2, 4, 64, 4, seed=13)
    plan = _plan(("prefill", 70), ("decode", 20))
    portable, fused = (gdn_forward(x, a, b, plan, GdnLayer(weight, A_log, dt_bias, 2, False, 1e-5, kernels))
                       for kernels in ("portable", "portable-fma"))  # fmt: skip
    assert torch.equal(portable[:, :70].view(torch.int16), fused[:, :70].view(torch.int16))
    torch.testing.assert_close(fused[:, 70:].float(), portable[:, 70:].float(), rtol=0.02, atol=0.02)
    gen = torch.Generator().manual_seed(3)  # three decoded tokens, each its fp32 state: the fused sums show in the state
    q, k, v = (torch.randn(3, h, 64, generator=gen).to(BF16) for h in (2, 2, 4))
    g, beta = gating((torch.randn(3, 4, generator=gen) * 2).to(BF16), torch.randn(3, 4, generator=gen).to(BF16), A_log, dt_bias,
                     decode=True)  # fmt: skip
    start = torch.randn(3, 4, 64, 64, generator=gen) * 0.3
    states = {kernels: start.clone() for kernels in ("portable", "portable-fma")}
    outs = {kernels: decode_rule(q, k, v, g, beta, state, False, 1e-5, kernels) for kernels, state in states.items()}
    assert not torch.equal(states["portable"], states["portable-fma"])
    torch.testing.assert_close(states["portable-fma"], states["portable"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["portable-fma"].float(), outs["portable"].float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("kernels", ["portable", "portable-fma", "avx512"])
def test_the_kernels_give_the_same_bits_on_any_number_of_threads(kernels: str) -> None:
    """The kernels split a layer's value heads (and the conv's outputs) over torch's threads, each head its own
    arithmetic: a trainer on 1 thread and one on 2 get the engine's bits alike (the engine's threads are its own)."""
    if kernels == "avx512" and not torch.cpu._is_avx512_supported():
        pytest.skip("the AVX-512 build's kernels call this CPU's VRCP14PS: no AVX-512 here")
    x, weight, a, b, A_log, dt_bias = _layer_inputs(150, 2, 6, 64, 4, seed=11)
    layer = GdnLayer(weight, A_log, dt_bias, 2, False, 1e-5, kernels)
    plan = _plan(("prefill", 40), ("decode", 3), ("prefill", 60), ("decode", 47))
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(gdn_forward(x, a, b, plan, layer))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(),
    reason="libtorch runs no bf16 brgemm without AVX-512 BF16 (nor does the engine's AVX-512 build)",
)
def test_the_chunk_rule_calls_the_engines_own_brgemm_whose_sums_are_the_documented_ones_without_amx() -> None:
    """The AVX-512 build's chunk rule calls libtorch's bf16 brgemm, as the engine does (oneDNN's kernel for this CPU: AMX
    tiles on an AMX CPU). Without AMX it sums as the written-out brgemm (pairs from 0, odd element first, C added last):
    the same bits with the function unset, on chunks whole and partial."""
    from fx_precision.contract import gdn
    from fx_precision.contract.kernels import engine_kernels

    kernels = engine_kernels()
    assert kernels.torch_brgemm is not None  # libtorch exports it on every x86 build of torch 2.13
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX: libtorch's brgemm runs tiles here, not the written-out VDPBF16PS sums")
    g = torch.Generator().manual_seed(5)
    L, H, Hv, D = 150, 2, 4, 64
    q, k = torch.randn(L, H, D, generator=g).to(BF16), torch.randn(L, H, D, generator=g).to(BF16)
    v, beta = torch.randn(L, Hv, D, generator=g).to(BF16), torch.rand(L, Hv, generator=g).to(BF16)
    decay = -torch.rand(L, Hv, generator=g) * 0.1
    runs = []
    try:
        for call in (kernels.torch_brgemm, (None, None)):
            kernels.lib.fxp_gdn512_set_brgemm(*call)
            state = torch.randn(Hv, D, D, generator=torch.Generator().manual_seed(6)) * 0.1
            runs.append((gdn.chunk512(q, k, v, decay, beta, state, 1e-6), state))
    finally:
        kernels.lib.fxp_gdn512_set_brgemm(*kernels.torch_brgemm)
    (out, state), (written_out, written_state) = runs
    assert torch.equal(out.view(torch.int16), written_out.view(torch.int16)) and torch.equal(
        state.view(torch.int32), written_state.view(torch.int32)
    )


def test_the_reference_is_the_models_own_delta_rule() -> None:
    """gdn_reference's rule is transformers' (the training side's) chunked gated delta rule, l2-normalised q / k."""
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next", reason="transformers with Qwen3-Next")
    H, Hv, D, K, T = 2, 4, 64, 4, 90
    x, weight, a, b, A_log, dt_bias = (t.float() for t in _layer_inputs(T, H, Hv, D, K, seed=7))
    ours = gdn_reference(x, weight, a, b, A_log, dt_bias, H, 1e-6)
    mixed = torch.nn.functional.silu(torch.nn.functional.conv1d(torch.nn.functional.pad(x, (K - 1, 0)), weight, groups=x.shape[1]))
    mixed = mixed.transpose(1, 2)
    q, k, v = mixed.split([H * D, H * D, Hv * D], dim=-1)
    q, k, v = q.reshape(1, T, H, D), k.reshape(1, T, H, D), v.reshape(1, T, Hv, D)
    q, k = q.repeat_interleave(Hv // H, dim=2), k.repeat_interleave(Hv // H, dim=2)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    theirs, _ = mod.torch_chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(b), use_qk_l2norm_in_kernel=True)
    assert torch.allclose(ours, theirs.float(), atol=2e-4, rtol=1e-3)


def test_rows_never_computed_are_zero_and_bad_plans_and_dims_are_refused() -> None:
    x, weight, a, b, A_log, dt_bias = _layer_inputs(20, 2, 4, 64, 4, seed=3)
    got = gdn_forward(x, a, b, _plan(("prefill", 15), ("none", 5)), GdnLayer(weight, A_log, dt_bias, 2, False, 1e-5))
    assert torch.equal(got[0, 15:], torch.zeros_like(got[0, 15:])) and got[0, :15].abs().sum() > 0
    bad = torch.tensor([[0] * 10 + [3] * 10], dtype=torch.int32)  # a piece that says it starts where it does not
    with pytest.raises(PrecisionError, match=r"gdn plan: row 10 is in the piece starting at row 3"):
        gdn_forward(x, a, b, bad, GdnLayer(weight, A_log, dt_bias, 2, False, 1e-5))
    x32, w32, a32, b32, A32, dt32 = _layer_inputs(20, 2, 4, 32, 4, seed=3)
    with pytest.raises(PrecisionError, match=r"no head dim the engine runs \(64, 128"):
        gdn_forward(x32, a32, b32, _plan(("prefill", 20)), GdnLayer(w32, A32, dt32, 2, False, 1e-5))
    with pytest.raises(PrecisionError, match=r"fxp_engine.gdn at layer.0 ran outside .*engine_rows"):
        engine_gdn(x, weight, a, b, A_log, dt_bias, 2, False, 1e-5, "portable", "layer.0")
    with pytest.raises(PrecisionError, match=r"GdnForm.kernels='avx512-amx'"):
        GdnForm("avx512-amx", "fp32", 1e-5)
    with pytest.raises(PrecisionError, match=r"GdnForm.state='bf16': the AVX-512 build's kernels are followed with an fp32"):
        GdnForm("avx512", "bf16", 1e-5)


# ---------------------------------------------------------------------------------------------
# the rewrite on transformers' models
# ---------------------------------------------------------------------------------------------


def _hybrid(name: str) -> tuple[Any, torch.Tensor, LinearOrders]:
    """A held-out hybrid: 1 full-attention layer among 3 linear-attention ones (not the 3:1 tail), linear head dim 128,
    Qwen3-Next's MLPs dense (mlp_only_layers), a 70-token batch row."""
    import transformers

    from fx_precision.contract.linear_order import engine_linear_shapes

    dims = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=128, linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, initializer_range=0.05,
                layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])  # fmt: skip
    if name == "qwen3-next":
        config = transformers.Qwen3NextConfig(**dims, mlp_only_layers=[0, 1, 2, 3], num_experts=4, num_experts_per_tok=2)
        cls = transformers.Qwen3NextForCausalLM
    else:
        config, cls = transformers.Qwen3_5TextConfig(**dims), transformers.Qwen3_5ForCausalLM
    torch.manual_seed(1)
    model = cls(config).float().eval()
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    shapes = engine_linear_shapes(model, input_ids=ids[:, :4])
    orders = LinearOrders.uniform(shapes, [70], lambda k: candidate_orders(k, 1)[0])
    return model, ids, orders


@pytest.mark.needs_transformers
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_a_hybrid_runs_one_gdn_op_per_layer_and_trains_close_to_the_model(name: str) -> None:
    import copy

    from fx_precision.backend import make_precision_backend

    model, ids, orders = _hybrid(name)
    fused = hasattr(model.model.layers[0].linear_attn, "in_proj_qkvz")
    assert fused == (name == "qwen3-next")  # Qwen3-Next's fused projections, Qwen3.5's split ones
    model = model.to(BF16).train()
    reference = copy.deepcopy(model)  # the model's own forward and gradients, the same weights
    layers = sum(1 for t in model.config.layer_types if t == "linear_attention")
    contract = EngineContract(attention=VEC, linears=orders, gdn=GdnForm(PORTABLE, "fp32", 1e-5))
    policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=contract)
    backend = make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    rows = torch.full(tuple(ids.shape), ids.shape[1], dtype=torch.int32)
    plan = _plan(("prefill", 50), ("decode", 20))
    with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders, gdn=plan)):
        logits = compiled(input_ids=ids, use_cache=False).logits
        logits.float().square().mean().backward()
    report = backend.reports[0]
    assert report.rewrites.get("engine-gdn") == 2 * layers, report.rewrites  # the core and the gated norm of each layer
    own = reference(input_ids=ids, use_cache=False).logits
    own.float().square().mean().backward()
    assert (logits.float() - own.float()).abs().max() < 0.1
    params = dict(model.named_parameters())
    for pname, p in reference.named_parameters():
        if ".linear_attn." not in pname:
            continue
        got = params[pname].grad
        assert got is not None and torch.isfinite(got.float()).all(), pname
        cos = torch.nn.functional.cosine_similarity(got.float().flatten(), p.grad.float().flatten(), dim=0)
        assert cos > 0.95, f"{pname}: cosine {cos.item():.3f} to the model's own gradient"
