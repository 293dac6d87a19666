"""The compiled engine's norm sums, read off Inductor's output code and computed in that order on the training side.

ordered_sum_squares(x, lanes, width)  ==  Inductor's own kernel for mean(x ** 2), bit for bit, at the lanes its
                                          code shows (bf16 rows: 32 on AVX-512, fp32 rows: 16; a masked tail too)
norm_reductions_of(output code)       the sums of squares in the order ``call`` runs the kernels (a kernel called
                                          twice counts twice); other reductions skipped
per-layer graphs (FSDP2's breaks)     under the engine's orders == the engine's one whole-model graph, bit for bit
bind_norm_modules                     the orders on a transformers model's norm modules, in the order a forward
                                          calls them; a count or a width that differs is refused in one line
a stream the model adds itself        (Granite: residual + h * multiplier, bf16) Inductor keeps it fp32 and rounds it
                                          where a norm's kernel stores it: ``stores`` read off the code, and the
                                          stream rounded there gives the kernels' bits (not rounded: it does not)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fx_precision.contract import EngineContract
from fx_precision.contract.inductor_norms import (
    NormReduction,
    bind_norm_modules,
    norm_reductions_of,
    ordered_sum_squares,
    register_norm_orders,
)
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16


def _inductor_mean_of_squares(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(lambda t: t.float().pow(2).mean(-1, keepdim=True), backend="inductor", dynamic=False)
    out, (code, *_) = run_and_get_code(fn, x)
    return out, code


@pytest.mark.parametrize("simdlen", [None, 256], ids=["native", "avx2-width"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_the_ordered_sum_is_inductors_own_kernel_bit_for_bit(dtype: torch.dtype, simdlen: int | None) -> None:
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from fx_precision.engines.vllm.cpu_family import cpu_flags

    if pick_vec_isa() is None or (simdlen is not None and "avx2" not in cpu_flags()):
        pytest.skip("Inductor picks no vector ISA of that width on this CPU: its sums are scalar here, which the rollout does not "
                    "read (engine_norm_reductions: none found, FSDP2 refused with that reason)")  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for size in (128, 1024, 80):  # 80: a tail shorter than the lanes
        x = (torch.randn(257, size, generator=gen) * 3).to(dtype)
        with inductor_config.patch({"cpp.simdlen": simdlen}):
            out, code = _inductor_mean_of_squares(x)
        (reduction,) = norm_reductions_of(code)
        assert reduction.size == size and reduction.lanes in (8, 16, 32) and reduction.lanes % reduction.width == 0
        assert torch.equal(ordered_sum_squares(x, reduction.lanes, reduction.width) / size, out), (dtype, size, reduction)
        if size == 1024:  # the order matters: the other width Inductor picks gives other bits
            other = reduction.width if reduction.lanes != reduction.width else 2 * reduction.width
            assert not torch.equal(ordered_sum_squares(x, other, reduction.width) / size, out)


_KERNEL = """cpp_fused_{name} = async_compile.cpp_pybinding(['const float*', 'float*', 'const int64_t'], r'''
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)
{{
    float tmp_acc0 = 0;
    at::vec::{vec} tmp_acc0_vec = at::vec::{vec}(0);
    for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>({size}L); x1+=static_cast<int64_t>({lanes}L))
    {{
        auto tmp0 = at::vec::Vectorized<float>::loadu(in_ptr0 + x1, static_cast<int64_t>({lanes}));
        auto tmp1 = tmp0 {op} tmp0;
        tmp_acc0_vec = tmp_acc0_vec + tmp1;
    }}
    tmp_acc0 = tmp_acc0 + at::vec::vec_reduce_all<float, 1>([](auto& x, auto& y) {{ return x + y; }}, tmp_acc0_vec);
}}
''')
"""


def test_the_reductions_are_read_in_the_order_call_runs_the_kernels() -> None:
    """Kernels are defined once and called where the graph needs them (vLLM's q / k norm kernel serves every layer)."""
    source = "".join((
        _KERNEL.format(name="norm_a", vec="VectorizedN<float,2>", size=128, lanes=32, op="*"),
        _KERNEL.format(name="norm_b", vec="Vectorized<float>", size=64, lanes=16, op="*"),
        _KERNEL.format(name="not_a_norm", vec="Vectorized<float>", size=64, lanes=16, op="+"),
        "class Runner:\n    def call(self, args):\n        cpp_fused_norm_b(a, b, s)\n        cpp_fused_not_a_norm(a, b, s)\n"
        "        cpp_fused_norm_a(a, b, s)\n        cpp_fused_norm_b(a, b, s)\n        return (b, )\n",
    ))  # fmt: skip
    assert [(r.lanes, r.width, r.size) for r in norm_reductions_of(source)] == [(16, 16, 64), (32, 16, 128), (16, 16, 64)]
    assert norm_reductions_of(source.split("class Runner")[0]) == ()  # no call: no order, nothing read


@torch.library.custom_op("fxp_test::block", mutates_args=())
def _block(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A layer's block between two norms (the engine's GEMMs and attention are extern calls): eager ``x @ g``, the same
    kernel on both sides (Inductor's own extern mm may split its work otherwise)."""
    return torch.mm(x, g)


@_block.register_fake
def _(x, g):
    return x.new_empty(x.shape[0], g.shape[1])


def _granite_stream(
    ids: torch.Tensor, emb: torch.Tensor, gemms: list[torch.Tensor], norms: list[torch.Tensor], scales: tuple[float, float]
) -> torch.Tensor:
    """vLLM's Granite stream in its native forms: the embedding scaled, each layer ``h + f(norm(h)) * m`` in bf16 (an
    extern call for the block), the norms ``(x.float() * rsqrt(mean(x ** 2) + eps)).to(bf16) * w``, the last norm's output."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16) * w

    h = torch.nn.functional.embedding(ids, emb) * scales[0]
    for w, g in zip(norms, gemms, strict=False):
        h = h + _block(norm(h, w), g) * scales[1]
    return norm(h, norms[-1])


def _granite_followed(
    ids: torch.Tensor,
    emb: torch.Tensor,
    gemms: list[torch.Tensor],
    norms: list[torch.Tensor],
    scales: tuple[float, float],
    reductions: tuple[NormReduction, ...],
    rounded: bool,
) -> torch.Tensor:
    """The same in eager torch as the contract computes it: the stream fp32 from the embedding, each norm's squares in
    its engine order, and (``rounded``) the stream rounded where the engine's kernel stores it."""
    s = torch.nn.functional.embedding(ids, emb).float() * scales[0]
    out = s
    for i, r in enumerate(reductions):
        if rounded and r.stores is not None and r.summed == "stored":
            s = s.to(getattr(torch, r.stores)).float()
        squares = ordered_sum_squares(s, r.lanes, r.width)
        if rounded and r.stores is not None:
            s = s.to(getattr(torch, r.stores)).float()
        out = ((s * torch.rsqrt(squares / r.size + 1e-6)) * norms[i].float()).to(BF16)  # the kernel's 1 / std::sqrt, here
        if i < len(gemms):
            s = s + _block(out, gemms[i]).float() * scales[1]
    return out


def test_a_stream_the_model_adds_itself_is_rounded_where_the_engines_kernel_stores_it() -> None:
    """Inductor realises a pointwise chain that reads too many buffers: Granite's stream, stored bf16 every few layers.
    The stores read off the code, rounded there, give the compiled kernels' bits; fp32 throughout does not."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    if pick_vec_isa() is None:
        pytest.skip("Inductor picks no vector ISA on this CPU: its sums are scalar here, which the rollout does not read")
    gen = torch.Generator().manual_seed(3)
    size, layers, scales = 192, 10, (11.0, 0.27)
    emb = (torch.randn(500, size, generator=gen) * 0.05).to(BF16)
    gemms = [(torch.randn(size, size, generator=gen) * 0.08).to(BF16) for _ in range(layers)]
    norms = [(1 + torch.randn(size, generator=gen) * 0.1).to(BF16) for _ in range(layers + 1)]
    ids = torch.randint(0, 500, (203,), generator=gen)
    torch._dynamo.reset()
    engine, (code, *_) = run_and_get_code(torch.compile(_granite_stream, backend="inductor", dynamic=False), ids, emb, gemms, norms, scales)
    reductions = norm_reductions_of(code)
    kinds = {(r.stores, r.summed) for r in reductions}  # stored in the reduction's loop, and in a loop before it
    assert len(reductions) == layers + 1 and {("bfloat16", "fp32"), ("bfloat16", "stored")} <= kinds, reductions
    assert not all(r.stores for r in reductions)  # rounded every few layers, not at every norm
    followed = _granite_followed(ids, emb, gemms, norms, scales, reductions, rounded=True)
    assert torch.equal(followed, engine), f"{int((followed != engine).sum())} of {engine.numel()} differ"
    assert not torch.equal(_granite_followed(ids, emb, gemms, norms, scales, reductions, rounded=False), engine)
    assert NormReduction.from_dict(reductions[0].to_dict()) == reductions[0]
    old = {k: v for k, v in reductions[0].to_dict().items() if k not in ("stores", "summed")}  # a dump written before them
    assert NormReduction.from_dict(old).stores is None


class _Norms(nn.Module):
    """The test model's norm weights as modules, as a transformers model holds them (the op finds a norm by its weight)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, w in weights.items():
            module = nn.Module()
            module.weight = nn.Parameter(w, requires_grad=False)
            self.add_module(name, module)


def test_per_layer_graphs_under_the_engines_orders_equal_its_whole_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine compiles its model as one graph; a training side broken into units (FSDP2) fuses its norms as its own
    graphs have them. Under the orders read off the engine's own output code each unit's norms are summed in the
    engine's order (the op's calls, in turn) and the per-layer graphs give the engine's bits."""
    import fx_precision.contract.inductor_norms as inductor_norms

    summed: list[int] = []
    plain = inductor_norms.ordered_sum_squares

    def spy(x: torch.Tensor, lanes: int, width: int) -> torch.Tensor:
        summed.append(lanes)
        return plain(x, lanes, width)

    monkeypatch.setattr(inductor_norms, "ordered_sum_squares", spy)
    from dataclasses import replace

    from torch._inductor.utils import run_and_get_code

    import fx_precision.contract.ops  # noqa: F401
    from tests.test_compiled_engine_contract import HEAD_DIM, _compiled_contract, _tf_compiled, _vllm_layer, _weights

    w = _weights(5)
    order = ["in0", "q_norm0", "post0", "in1", "q_norm1", "post1", "final"]  # the order both sides call the norms
    holder = _Norms({name: w[name] for name in order})
    w = w | {name: getattr(holder, name).weight for name in order}  # the same tensors the modules hold
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    freqs = torch.einsum("i,j -> ij", torch.arange(2048).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(BF16)
    for rows in (301, 1500):
        emb = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 0.5).to(BF16)
        positions = torch.arange(rows)
        torch._dynamo.reset()
        engine, (code, *_) = run_and_get_code(torch.compile(_vllm_layer, backend="inductor", dynamic=True), emb, w, cos_sin, positions)
        reductions = norm_reductions_of(code)
        assert [r.size for r in reductions] == [128, HEAD_DIM, 128, 128, HEAD_DIM, 128, 128]
        bound = tuple(NormReduction(r.lanes, r.width, r.size, name) for r, name in zip(reductions, order, strict=True))
        register_norm_orders(holder, bound)
        contract = replace(_compiled_contract(), norm_reductions=bound)
        followed, _ = _tf_compiled(rewrite=True, contract=contract)
        summed.clear()
        got = followed(emb, w, inv_freq, positions, True).to(BF16)  # a unit's fp32 stream: the engine's last norm stores bf16
        assert torch.equal(got, engine), f"{rows} rows: {int((got != engine).sum())} of {got.numel()} differ"
        assert summed == [r.lanes for r in reductions]  # every norm of every unit summed in its engine order, in turn
        summed.clear()


@pytest.mark.needs_transformers
def test_the_orders_bind_to_a_models_norms_in_forward_order_or_are_refused() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    sizes = [64, 32, 32, 64] * 2 + [64]
    bound = bind_norm_modules(tuple(NormReduction(32, 16, s) for s in sizes), model)
    assert [r.module for r in bound[:4]] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn.q_norm",
                                            "model.layers.0.self_attn.k_norm", "model.layers.0.post_attention_layernorm"]  # fmt: skip
    assert bound[-1].module == "model.norm" and len({r.module for r in bound}) == 9
    with pytest.raises(PrecisionError, match="holds 8 norm reduction"):
        bind_norm_modules(tuple(NormReduction(32, 16, s) for s in sizes[:8]), model)
    with pytest.raises(PrecisionError, match=r"model\.layers\.0\.self_attn\.q_norm"):
        bind_norm_modules(tuple(NormReduction(32, 16, s) for s in [64, 64, 32, 32, *sizes[4:]]), model)


def test_the_contract_carries_the_orders_and_refuses_them_without_inductor() -> None:
    from fx_precision.backend import check_compiled_engine
    from fx_precision.contract.inductor_build import inductor_build
    from fx_precision.contract.ops import inductor_sum_squares  # the op, registered by its module (not by test order)
    from tests.test_compiled_engine_contract import _compiled_contract

    contract = EngineContract(**{**_compiled_contract().__dict__, "norm_reductions": (NormReduction(32, 16, 128, "model.norm"),)})
    assert EngineContract.from_dict(contract.to_dict()) == contract and "1 at 32 lanes" in contract.describe()
    with pytest.raises(PrecisionError, match="inductor is null"):
        EngineContract(norm_reductions=(NormReduction(32, 16, 128),))
    with pytest.raises(PrecisionError, match="whole vectors"):
        NormReduction(24, 16, 128)
    with pytest.raises(PrecisionError, match="FSDP2"):
        check_compiled_engine(inductor_build(), "inductor", world_size=2)
    check_compiled_engine(inductor_build(), "inductor", world_size=2, norm_orders=True)
    with pytest.raises(PrecisionError, match="no bound norm module holds it"):
        inductor_sum_squares(torch.ones(2, 8), torch.ones(8))


def test_the_engines_code_is_told_from_another_isas_in_the_same_cache(tmp_path: Path) -> None:
    """vLLM keeps the same model compiled under another --isa in the same directory: the code of the engine's own
    vector width is read; two graphs of that width are refused (their order is not known)."""
    from fx_precision.contract.inductor_norms import engine_norm_reductions

    def write(name: str, vec: str, lanes: int) -> None:
        (tmp_path / "inductor_cache" / name).mkdir(parents=True)
        kernel = _KERNEL.format(name="norm", vec=vec, size=128, lanes=lanes, op="*")
        (tmp_path / "inductor_cache" / name / "c.py").write_text(kernel + "def call(self, args):\n    cpp_fused_norm(a, b, s)\n")

    write("a", "VectorizedN<float,2>", 32)  # AVX-512: 16 floats a vector
    write("b", "VectorizedN<float,2>", 16)  # AVX2: 8
    assert engine_norm_reductions(str(tmp_path))[0] is None
    (avx512,), _ = engine_norm_reductions(str(tmp_path), 16)
    (avx2,), _ = engine_norm_reductions(str(tmp_path), 8)
    assert (avx512.lanes, avx512.width, avx2.lanes, avx2.width) == (32, 16, 16, 8)
    write("c", "Vectorized<float>", 16)
    reductions, why = engine_norm_reductions(str(tmp_path), 16)
    assert reductions is None and "spread over 2 compiled graphs" in why


def test_an_engines_narrower_vector_isa_is_followed_by_its_width_and_an_unknown_one_refused() -> None:
    """The engine's Inductor build as the contract holds it: the simdlen field is how an ISA was chosen, not what; an
    engine that compiled at a narrower ISA this CPU runs (vLLM's avx2 family on an AVX-512 CPU) is followed by setting
    cpp.simdlen to that width, and the compiled training graph is then generated for it; one no width here picks (another
    torch, another architecture) is refused in one line, naming both builds."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    from fx_precision.backend import check_compiled_engine
    from fx_precision.contract.inductor_build import following_simdlen, inductor_build, same_build

    here = inductor_build()
    assert same_build(here, here.replace("simdlen None", "simdlen 512")) and following_simdlen(here) is None
    other = here.replace(torch.__version__, "0.0.0")
    assert not same_build(here, other) and following_simdlen(other) is None
    with pytest.raises(PrecisionError, match="no vector width of this CPU picks the engine's") as refused:
        check_compiled_engine(other, "inductor")
    assert "\n" not in str(refused.value) and "0.0.0" in str(refused.value)
    widths = sorted({isa.bit_width() for isa in valid_vec_isa_list()})
    if len(widths) < 2:
        pytest.skip(f"this CPU's Inductor has one vector width ({widths}): no narrower ISA to follow")
    narrow = inductor_build(widths[0]).replace(f"simdlen {widths[0]}", "simdlen None")  # as an engine at that ISA records it
    assert not same_build(here, narrow) and following_simdlen(narrow) == widths[0]
    check_compiled_engine(narrow, "inductor")  # followed: no refusal

    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with config.patch({"cpp.simdlen": following_simdlen(narrow)}):
        fn = torch.compile(lambda t: t.float().pow(2).mean(-1, keepdim=True), backend="inductor", dynamic=False)
        _, (code, *_) = run_and_get_code(fn, torch.randn(4, 256).to(BF16))
    read = norm_reductions_of(code)
    assert len(read) == 1 and read[0].width == widths[0] // 32, read  # the kernel's vectors: the engine's width in floats
