"""The engine contract without an engine: its ops, their gradients, the rewrites on every sweep architecture,
the row plans, and training under it. The live-engine tests are in tests/engine (the engine environment)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fx_precision as fxp
from fx_precision.contract import AttentionArithmetic, EngineContract, RotaryOp
from fx_precision.contract.batch_rows import EngineRows, RowPlan, check_logits_calls, engine_rows, row_plans, steps_of
from fx_precision.contract.evidence import (
    AttentionEvidence,
    CandidateEvidence,
    ContractEvidence,
    LinearCallEvidence,
    LinearEvidence,
    LogprobEvidence,
    RunCallsChecked,
    keeping,
    value_record,
)
from fx_precision.contract.kernels import attention_variant, engine_kernels
from fx_precision.contract.linear_order import LinearCall, LinearKernel, LinearOrder, LinearOrders, candidate_orders
from fx_precision.contract.ops import engine_attention, engine_linear, engine_rotary
from fx_precision.contract.vocabulary import LogprobForm, NormForm
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
VEC = AttentionArithmetic(scores="vec", exp="libm", reduce="avx2", p_bf16=False, fma=False, store="truncate")  # the AVX2 build's
SOME_ORDER = LinearOrders(1, (LinearCall(64, 32, 8, LinearOrder.sequential(32)),))  # rewrites need orders; these graphs never run
PORTABLE = EngineContract(rotary=RotaryOp(rounding="truncate"), attention=VEC, linears=SOME_ORDER)  # any x86 CPU: no AMX needed
NEAREST = EngineContract(rotary=RotaryOp(rounding="nearest-even"), attention=VEC, linears=SOME_ORDER)  # rotary in the graph
BLOCKED = LinearOrder(blocks=(3, 3, 2), parts=(2, 1))  # 8 chunks of 32: K = 256, in two parts (a split across engine threads)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    heads = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k.repeat_interleave(heads, 2), v.repeat_interleave(heads, 2)))
    return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None).transpose(1, 2)


def test_the_contract_round_trips_and_refuses_what_it_cannot_be() -> None:
    contract = PORTABLE.with_attention(exp="fast512")
    assert EngineContract.from_dict(json.loads(json.dumps(contract.to_dict()))) == contract
    with pytest.raises(PrecisionError, match=r"AttentionArithmetic\.scores='gpu'"):
        AttentionArithmetic(scores="gpu")
    with pytest.raises(PrecisionError, match="the engine runs bf16 weights and bf16 compute"):
        fxp.PrecisionPolicy(compute=BF16, gather=torch.float32, contract=contract)
    with pytest.raises(PrecisionError, match=r"an fx_precision\.contract\.EngineContract"):
        fxp.PrecisionPolicy(compute=BF16, gather=BF16, contract="vllm")  # type: ignore[arg-type]
    assert "truncate store" in contract.describe() and "1 linear calls read on 1 engine thread" in contract.describe()


def _edited(data: dict, path: str, value: object) -> dict:
    """A deep copy of ``data`` with ``path`` (dotted; ``-`` deletes) set to ``value``."""
    out = json.loads(json.dumps(data))
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value == "-":
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "error"),
    [
        ("bogus", 1, "contract: unknown bogus"),
        ("attention", "-", "contract: missing attention"),
        ("rotary", "-", "contract: missing rotary"),
        ("attention.fma", "false", r"contract.attention.fma='false': true or false"),
        ("attention.scores", "gpu", r"contract.attention.scores='gpu': one of amx, vec"),
        ("norm", "sideways", r"contract.norm='sideways': one of fused-add, plain"),
        ("linears.calls.0.rows", "four", r"contract.linears.calls\[0\].rows: a positive integer, got 'four'"),
        ("linears.calls.0.rows", -3, r"rows: a positive integer, got -3"),
        ("linears.calls.0.rows", 4.5, r"rows: a positive integer, got 4.5"),
        ("linears", 5, r"contract.linears: an object with threads and calls"),
        ("evidence", 5, r"contract.evidence: a JSON object"),
        ("evidence.attention", {"kept": 3}, r"contract.evidence.attention.kept=3: a str"),
        ("evidence.linears", {"reads": {}}, r"contract.evidence.linears: unknown reads"),
        ("evidence.matched", {"attention": True}, r"contract.evidence.matched=.*but the evidence gives"),
        ("unmatched", [["norm"]], r"contract.unmatched: a list of \[op class, why\] pairs"),
        ("norm", None, "contract.norm: none, and unmatched holds no reason"),
    ],
)  # fmt: skip
def test_a_contract_is_typed_on_read(path: str, value: object, error: str) -> None:
    """Wrong types, ranges and missing fields are one PrecisionError naming the field: no default takes a removed op
    class's place, no string is read as a boolean."""
    with pytest.raises(PrecisionError, match=error):
        EngineContract.from_dict(_edited(PORTABLE.to_dict(), path, value))


def test_evidence_is_typed_and_survives_its_json() -> None:
    """Every probe's evidence is a dataclass the core reads by field: written to JSON and read back it is the same
    evidence, its ``matched`` record the one its fields give (the attention followed only where the run's calls held)."""
    evidence = ContractEvidence(
        attention_isa="vec", kernels="AVX512+BF16 (_C)", cpu_family="avx512-bf16",
        rotary=keeping(CandidateEvidence({"native": 12, "kernel, truncate store": 0}), RotaryOp(rounding="truncate")),
        norm=keeping(CandidateEvidence(details={"module": "GraniteRMSNorm: model"}), NormForm.PLAIN),
        attention=keeping(AttentionEvidence({VEC.describe(): 0}, not_tried={"amx": "no AMX tiles"}, separating_rounds=({"a": 1},),
                                            at_run=RunCallsChecked(5, 5, ("1 request(s) [(513, 513)]: 3 row(s) differ",))), VEC),
        linears=LinearEvidence({"q_proj 64x256 at 7 rows": keeping(LinearCallEvidence(7, 512, 1), BLOCKED)},
                               {"64x256 at 7 rows": value_record(BLOCKED)}),
        logprobs=keeping(LogprobEvidence(0, 0.7, 40, 0.8, 4, 4, {"raw": 0, "processed": 4}, mode="raw_logprobs"), LogprobForm.PROCESSED),
    )  # fmt: skip
    data = json.loads(json.dumps(evidence.to_dict()))
    assert ContractEvidence.from_dict(data) == evidence
    assert data["matched"] == {"rotary": True, "norm": True, "attention": False, "linears": True}  # the run's call parted
    assert replace(evidence, attention=replace(evidence.attention, at_run=RunCallsChecked(5, 5))).followed()["attention"]


def test_a_contract_its_evidence_contradicts_is_refused() -> None:
    """The contract must be what its probes kept: a dump whose attention was edited to another candidate, or a linear
    call's order to another order, is refused before a comparison runs."""
    from fx_precision.contract import contract_of_dump

    linears = LinearOrders(1, (LinearCall(64, 256, 7, BLOCKED),))
    rotary = RotaryOp(rounding="truncate")
    evidence = ContractEvidence(norm=keeping(CandidateEvidence(), NormForm.FUSED_ADD), rotary=keeping(CandidateEvidence(), rotary),
                                attention=keeping(AttentionEvidence(), VEC), logprobs=keeping(LogprobEvidence(), LogprobForm.RAW),
                                linears=LinearEvidence(read={"64x256 at 7 rows": value_record(BLOCKED)}))  # fmt: skip
    honest = EngineContract(rotary=rotary, attention=VEC, linears=linears, evidence=evidence)
    contract_of_dump(SimpleNamespace(contract=honest.to_dict()))  # its evidence holds it
    edited = _edited(honest.to_dict(), "attention.exp", "fast512")
    with pytest.raises(PrecisionError, match=r"contract.attention is .*but its probe kept"):
        contract_of_dump(SimpleNamespace(contract=edited))
    edited = _edited(honest.to_dict(), "linears.calls.0.order.blocks", [8])
    edited["linears"]["calls"][0]["order"]["parts"] = [1]
    with pytest.raises(PrecisionError, match=r"the call 64x256 at 7 rows is summed as 'AMX: K in order', its probe read"):
        contract_of_dump(SimpleNamespace(contract=edited))
    edited = _edited(honest.to_dict(), "logprobs", "processed")
    edited["evidence"]["logprobs"] = {"kept": "raw", "record": {"form": "raw"}}
    with pytest.raises(PrecisionError, match=r"contract.logprobs is 'processed', but its probe kept 'raw'"):
        contract_of_dump(SimpleNamespace(contract=edited))
    edited = _edited(honest.to_dict(), "evidence.attention.record.fma", True)  # the record, not the words: one field edited
    with pytest.raises(PrecisionError, match=r"contract.attention is .*but its probe kept"):
        contract_of_dump(SimpleNamespace(contract=edited))
    edited = _edited(honest.to_dict(), "evidence.norm.record", "-")  # the words alone are not evidence
    with pytest.raises(PrecisionError, match=r"contract.evidence.norm: no record of what the probe kept"):
        contract_of_dump(SimpleNamespace(contract=edited))


def test_an_op_class_the_probe_could_not_match_is_refused_by_its_rewrite() -> None:
    """No default stands in for what the probe could not match: a graph with attention under a contract whose attention
    is unmatched is refused, naming the op class and the probe's reason."""
    from fx_precision.backend import make_precision_backend

    blind = replace(PORTABLE, attention=None, unmatched=(("attention", "no candidate gives the engine's attention bits at prefill"),))
    policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=blind)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=make_precision_backend(policy=policy, inner="aot_eager"))
    q = torch.randn(1, 2, 8, 32).to(BF16)
    with pytest.raises(Exception) as raised, policy.forward_context("cpu"):  # Dynamo wraps a backend's error (BackendCompilerFailed)
        compiled(q, q, q)
    refusal = fxp.precision_error_in(raised.value)
    assert refusal is not None and "attention at <root>" in str(refusal)
    assert "no candidate gives the engine's attention bits" in str(refusal)
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:  # traced without autocast: nothing of the contract would run, so refused
        compiled(q, q, q)
    assert "traced without autocast" in str(fxp.precision_error_in(raised.value))


def test_vec_attention_is_fp32_attention_stored_once_and_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 37, 4, 32).to(BF16), torch.randn(3, 37, 2, 32).to(BF16), torch.randn(3, 37, 2, 32).to(BF16)
    out = engine_attention(q, k, v, torch.full((3,), 37), None, 32**-0.5, True, -1, 0, **VEC.op_args())
    assert out.dtype == BF16 and (out.float() - _reference(q, k, v)).abs().max() < 2e-2
    alone = engine_attention(q[1:2], k[1:2], v[1:2], torch.tensor([37]), None, 32**-0.5, True, -1, 0, **VEC.op_args())
    assert torch.equal(alone, out[1:2])  # a row of the batch is the row alone
    # a boolean mask (sliding window of 5) and the same mask given as window= agree bit for bit
    pos = torch.arange(37)
    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 5)
    by_mask = engine_attention(q, k, v, torch.full((3,), 37), window[None, None], 32**-0.5, False, -1, 0, **VEC.op_args())
    by_window = engine_attention(q, k, v, torch.full((3,), 37), None, 32**-0.5, True, 4, 0, **VEC.op_args())
    assert torch.equal(by_mask, by_window)
    truncated = by_mask.float().view(torch.int32) & 0xFFFF  # the store truncates: bf16 from the fp32 high half
    assert int(truncated.abs().sum()) == 0


def test_amx_attention_runs_the_hardware_instruction_or_says_it_cannot() -> None:
    q, k, v = (torch.randn(1, 40, 2, 32).to(BF16) for _ in range(3))
    codes = AttentionArithmetic().op_args()
    if not engine_kernels().cpu_has_amx():
        with pytest.raises(PrecisionError, match="this CPU has no AMX"):
            engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, **codes)
        pytest.skip("this CPU has no AMX: the refusal is checked, the AMX instruction cannot run here")
    out = engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, **codes)
    again = engine_attention(q, k, v, torch.tensor([40]), None, 32**-0.5, True, -1, 0, **codes)
    assert torch.equal(out, again) and (out.float() - _reference(q, k, v)).abs().max() < 2e-2


def test_amx_attention_16_rows_per_tile_is_the_one_row_reference_bit_for_bit() -> None:
    """The AMX kernel runs 16 query rows per tile (keys a row does not see enter with p = 0); every row must be
    the bits of the one-row reference, the engine's order, on every mask form: causal, window, padding, boolean
    masks per head, decode offsets, GQA, head dims of 32 to 128, and scores large enough to underflow exp."""
    from fx_precision.contract.ops.attention import _require_amx

    if not engine_kernels().cpu_has_amx():
        with pytest.raises(PrecisionError, match="this CPU has no AMX"):
            _require_amx()
        pytest.skip("this CPU has no AMX: the refusal is checked, the tiled AMX kernel cannot run here")
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
            variant = attention_variant(**arithmetic.op_args())
            args = (q, k, v, key_lens, mask, D**-0.5, causal, window, offset, variant)
            tiled, rowwise = engine_kernels().attention(*args), engine_kernels().attention(*args, rowwise=True)
            assert torch.equal(tiled.view(torch.int16), rowwise.view(torch.int16)), (B, T, S, H, KVH, D, causal, window, offset, arithmetic)


def test_a_mask_that_is_the_causal_range_runs_as_the_range() -> None:
    """transformers hands sdpa its causal mask as a tensor: the op runs it as causal=True with no mask (the same
    keys, no per-key reads), and keeps any mask that blocks more, row by row."""
    from fx_precision.contract.ops.attention import _mask_as_range

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
    codes = VEC.op_args()
    by_mask = engine_attention(q, k, v, full, holed, 32**-0.5, False, -1, 0, **codes)
    assert torch.equal(by_mask[1], engine_attention(q, k, v, full, None, 32**-0.5, True, -1, 0, **codes)[1])
    assert not torch.equal(by_mask[0, 5], engine_attention(q, k, v, full, None, 32**-0.5, True, -1, 0, **codes)[0, 5])


def test_attention_gradients_are_fp32_attention_gradients() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 9, 4, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    kk, vv = k[:, :, :2], v[:, :, :2]  # grouped-query: 4 query heads on 2 key/value heads
    out = engine_attention(q, kk, vv, torch.full((2,), 9), None, 32**-0.5, True, -1, 0, **VEC.op_args())
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


def _cancelling(rows: int, k: int, out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs on which summation orders part in the last bits: small random products, plus a huge one in K's first
    element that its last element cancels exactly, so every chunk added while it is in the sum rounds coarsely and a
    block summed from 0 does not. x [rows, k], w [out, k], bias [out]."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=gen) * 0.1
    x = torch.randn(rows, k, generator=gen)
    w[:, 0] = w[:, -1] = 1.0
    x[:, 0], x[:, -1] = 2.0**14, -(2.0**14)
    return x.to(BF16), w.to(BF16), torch.randn(out, generator=gen).to(BF16)


def test_the_linear_sums_each_row_in_the_order_of_its_engine_call() -> None:
    """Each row of fxp_engine.linear is summed in the order of the engine call that computed it (the row plan's rows
    per call): rows of a 7-row call in the blocked order, of a 3-row call in order, rows the engine never computed by
    torch's linear; the two orders part on these inputs, so the test sees which one ran. A call the contract read no
    order for, a plan of another batch and a forward outside engine_rows are refused."""
    x, w, b = _cancelling(10, 256, 64, seed=3)
    x = x.view(2, 5, 256)
    orders = LinearOrders(1, (LinearCall(64, 256, 7, BLOCKED), LinearCall(64, 256, 3, LinearOrder.sequential(256))))
    body = torch.tensor([[7, 7, 7, 0, 3], [3, 3, 7, 7, 0]], dtype=torch.int32)
    with engine_rows(EngineRows(body, torch.zeros_like(body), orders)):
        out = engine_linear(x, w, b, False, 0, "test.linear")
    kernels = engine_kernels()
    by_order = {7: kernels.linear(x.view(10, 256), w, b, BLOCKED.struct()), 3: kernels.linear(x.view(10, 256), w, b,
                LinearOrder.sequential(256).struct()), 0: torch.nn.functional.linear(x.view(10, 256), w, b)}  # fmt: skip
    assert not torch.equal(by_order[7], by_order[3])  # the orders part: which one ran shows
    expected = torch.stack([by_order[int(m)][i] for i, m in enumerate(body.flatten())]).view(2, 5, 64)
    assert torch.equal(out, expected)
    with engine_rows(EngineRows(torch.full((2, 5), 5, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int32), orders)):
        with pytest.raises(PrecisionError, match=r"linear 64x256 at test.linear computed rows in a call of 5 rows"):
            engine_linear(x, w, b, False, 0, "test.linear")
    with engine_rows(EngineRows(torch.full((1, 5), 7, dtype=torch.int32), torch.zeros(1, 5, dtype=torch.int32), orders)):
        with pytest.raises(PrecisionError, match="the row plan holds 5 rows"):
            engine_linear(x, w, b, False, 0, "test.linear")
    with pytest.raises(PrecisionError, match=r"ran outside fx_precision\.contract\.batch_rows\.engine_rows"):
        engine_linear(x, w, b, False, 0, "test.linear")


def test_the_linear_gives_the_same_bits_on_any_thread_count_with_or_without_amx() -> None:
    """The training side's own thread count never changes the engine linear's arithmetic (its work splits over
    outputs, never over K), and the order summed element by element (any CPU) is the AMX tiles' bit for bit."""
    x, w, b = _cancelling(37, 256, 80, seed=4)  # rows and outputs off the tiles' 16 and 32: their tails too
    kernels = engine_kernels()
    for order in (LinearOrder.sequential(256), BLOCKED, LinearOrder(blocks=(8,), parts=(1,))):
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(kernels.linear(x, w, b, order.struct()))
            results.append(kernels.linear(x, w, b, order.struct(), emulate=True))
        torch.set_num_threads(1)
        assert all(torch.equal(results[0], r) for r in results[1:]), order


def test_the_order_family_is_canonical_and_read_strictly() -> None:
    """Orders that add in the same sequence are one (a one-chunk block joins the block before it; a part of one
    block joins the part before it); the family has no repeats; a linear order or call read from a dump is
    checked field by field."""
    assert LinearOrder(blocks=(11, 11, 10), parts=(2, 1)).canonical() == LinearOrder(blocks=(11, 11, 10), parts=(3,))
    assert LinearOrder(blocks=(31, 1), parts=(1, 1)).canonical() == LinearOrder.sequential(1024)
    family = candidate_orders(1024, 2)
    assert len(family) == len(set(family)) and family[0] == LinearOrder.sequential(1024)
    assert LinearOrder(blocks=(11, 11, 10), parts=(3,)) in family and LinearOrder(blocks=(16, 16), parts=(1, 1)).canonical() in family
    small_batch = LinearOrder.sequential(256, LinearKernel.PAIRS, bias_first=True)
    orders = LinearOrders(2, (LinearCall(64, 256, 7, BLOCKED), LinearCall(64, 256, 2, small_batch)))
    assert LinearOrders.from_dict(json.loads(json.dumps(orders.to_dict()))) == orders
    bad = orders.to_dict()
    bad["calls"][0]["rows"] = "seven"
    with pytest.raises(PrecisionError, match=r"contract.linears.calls\[0\].rows: a positive integer, got 'seven'"):
        LinearOrders.from_dict(bad)
    bad = orders.to_dict()
    bad["calls"][0]["order"]["blocks"] = [3, 3]
    with pytest.raises(PrecisionError, match="parts"):
        LinearOrders.from_dict(bad)


@pytest.mark.needs_transformers
def test_the_training_side_gives_the_same_bits_on_one_and_two_threads() -> None:
    """A decoder 512 wide (intermediate 2048, 8 / 4 heads of 64) compiled under the contract, its every GEMM in an
    order split in two parts as on a two-thread engine: the logits of a forward on 1 thread and on 2 are the same bits
    (a trainer never runs on the engine's thread count)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fx_precision.backend import make_precision_backend
    from fx_precision.contract.linear_order import engine_linear_shapes

    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, 4096, (1, 96))
    split = lambda k: next(o for o in candidate_orders(k, 2) if len(o.parts) == 2 and len(o.blocks) > 2)
    orders = LinearOrders.uniform(engine_linear_shapes(model, input_ids=ids[:, :4]), [96], split, threads=2)
    attention = AttentionArithmetic() if engine_kernels().cpu_has_amx() else VEC
    contract = EngineContract(attention=attention, linears=orders)
    policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=contract)
    compiled = torch.compile(model, backend=make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager"))
    rows = torch.full((1, 96), 96, dtype=torch.int32)
    logits = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        with torch.no_grad(), policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            logits.append(compiled(input_ids=ids, use_cache=False).logits)
    torch.set_num_threads(1)
    assert logits[0].dtype == BF16 and all(torch.equal(logits[0].view(torch.int16), t.view(torch.int16)) for t in logits[1:])


@pytest.mark.needs_transformers
def test_models_of_other_head_widths_compile_under_the_contract_in_one_process() -> None:
    """Dynamo lifts a module's float (the attention scale) to a graph input once two models' values differ (automatic
    dynamic): the attention rewrite takes it as a run-time value, and the logits are the bits of a fresh compile."""
    import torch._dynamo
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fx_precision.backend import make_precision_backend
    from fx_precision.contract.linear_order import engine_linear_shapes

    def logits(head_dim: int) -> torch.Tensor:
        config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64)  # fmt: skip
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval()
        ids = torch.randint(0, 256, (1, 8))
        orders = LinearOrders.uniform(engine_linear_shapes(model, input_ids=ids[:, :4]), [8], lambda k: candidate_orders(k, 1)[0])
        attention = AttentionArithmetic() if engine_kernels().cpu_has_amx() else VEC
        contract = EngineContract(attention=attention, linears=orders)
        policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=contract)
        compiled = torch.compile(model, backend=make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager"))
        rows = torch.full((1, 8), 8, dtype=torch.int32)
        with torch.no_grad(), policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            return compiled(input_ids=ids, use_cache=False).logits

    torch._dynamo.reset()
    alone = logits(32)
    torch._dynamo.reset()
    after_others = [logits(16), logits(32)][1]
    torch._dynamo.reset()
    assert torch.equal(alone.view(torch.int16), after_others.view(torch.int16))


def test_the_residual_sum_lives_for_one_forward_under_the_contract() -> None:
    """The fused add + norm's fp32 sum crosses a graph break inside the forward engine_rows opens, and no further: the
    next graph's norm reads the exact sum (again on a recompute: read, not taken), a forward that ends drops what it
    kept, and the ops refuse to run outside one."""
    from fx_precision.contract.batch_rows import active_forward
    from fx_precision.contract.ops import residual_add, unrounded_residual

    a, b = torch.tensor([1.0, 3.0]).to(BF16), torch.tensor([2.0**-9, 2.0**-8]).to(BF16)  # sums bf16 cannot hold
    rows = torch.ones((1, 2), dtype=torch.int32)
    with engine_rows(EngineRows(rows, rows, SOME_ORDER)):
        s = residual_add(a, b)
        assert s.dtype == BF16 and not torch.equal(s.float(), a.float() + b.float())
        assert torch.equal(unrounded_residual(s), a.float() + b.float())
        assert torch.equal(unrounded_residual(s), a.float() + b.float())  # read again (a recompute): the same sum
        s.copy_(s + 1)  # the tensor now holds other values: its entry is never used for them
        assert torch.equal(unrounded_residual(s), s.float())
        residual_add(a, b)
        forward = active_forward()
        assert forward is not None and len(forward.residual_sums) == 2  # every sum of the forward, kept for its life
    assert active_forward() is None
    with engine_rows(EngineRows(rows, rows, SOME_ORDER)):
        copy = residual_add(a, b).clone()  # the same values in another tensor: not the sum's
        assert torch.equal(unrounded_residual(copy), copy.float())
    for op in (lambda: residual_add(a, b), lambda: unrounded_residual(a)):
        with pytest.raises(PrecisionError, match=r"outside fx_precision\.contract\.batch_rows\.engine_rows"):
            op()


def test_a_row_the_engine_call_summed_apart_is_summed_in_its_own_order() -> None:
    """A call whose row at index 3 the engine summed in another order (LinearCall.apart: oneDNN's jit GEMM on two
    threads, the middle row of an odd call): the rows the plan places at index 3 of a 7-row call take that order, the
    others the call's; rows at index 3 of another call do not. Without row indices in the plan, refused."""
    x, w, b = _cancelling(10, 256, 64, seed=5)
    x = x.view(2, 5, 256)
    sequential = LinearOrder.sequential(256)
    orders = LinearOrders(1, (LinearCall(64, 256, 7, BLOCKED, ((3, sequential),)), LinearCall(64, 256, 3, BLOCKED)))
    body = torch.tensor([[7, 7, 7, 7, 3], [3, 3, 7, 7, 7]], dtype=torch.int32)
    at = torch.tensor([[0, 1, 2, 3, 0], [1, 2, 3, 4, 5]], dtype=torch.int32)
    zeros = torch.zeros_like(body)
    with engine_rows(EngineRows(body, zeros, orders, body_at=at, logits_at=zeros)):
        out = engine_linear(x, w, b, False, 0, "test.linear")
    kernels = engine_kernels()
    blocked, apart = (kernels.linear(x.view(10, 256), w, b, o.struct()) for o in (BLOCKED, sequential))
    assert not torch.equal(blocked, apart)  # the orders part: which one ran shows
    expected = torch.stack([apart[i] if (m, a) == (7, 3) else blocked[i] for i, (m, a) in enumerate(zip(body.flatten().tolist(),
                            at.flatten().tolist(), strict=True))]).view(2, 5, 64)  # fmt: skip
    assert torch.equal(out, expected)
    with engine_rows(EngineRows(body, zeros, orders)), pytest.raises(PrecisionError, match="holds no row indices"):
        engine_linear(x, w, b, False, 0, "test.linear")


def test_linear_orders_keep_their_rows_apart_through_json_and_refuse_a_row_outside_the_call() -> None:
    orders = LinearOrders(2, (LinearCall(64, 256, 7, BLOCKED, ((3, LinearOrder.sequential(256)),)),))
    assert LinearOrders.from_dict(json.loads(json.dumps(orders.to_dict()))) == orders
    assert "1 call(s) with rows summed apart" in orders.describe()
    bad = orders.to_dict()
    bad["calls"][0]["apart"][0]["row"] = 7
    with pytest.raises(PrecisionError, match=r"contract\.linears\.calls\[0\]: LinearCall at 7 rows: apart rows \[7\]"):
        LinearOrders.from_dict(bad)


def test_row_plans_follow_the_engine_steps() -> None:
    # two prompts of 6 and 3 tokens prefilled together (9 rows), then 2 decode steps of 2 rows; b's
    # decode row (3, 4) repeats a row of a's prefill: rows are claimed in order, each once
    a, b = SimpleNamespace(tokens=(1, 2, 3, 4, 5, 6, 9, 8), prompt_len=6), SimpleNamespace(tokens=(7, 6, 5, 4, 3), prompt_len=3)
    prefill = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (0, 7), (1, 6), (2, 5)]
    steps = [prefill, [(6, 9), (3, 4)], [(7, 8), (4, 3)]]
    engine = {"steps": steps, "logits_calls": [[0, 2], [0, 5], [0, 2], [1, 2], [2, 2]]}
    plan_a, plan_b = row_plans([a, b], engine)
    assert plan_a.body == (9,) * 6 + (2, 2) and plan_b.body == (9,) * 3 + (2, 2)  # the rows of the forward that computed each
    assert plan_a.logits == (5,) * 5 + (2, 2)  # prompt log-probs in a call of 5 rows; then sampling, 2 rows per call
    assert plan_b.logits == (2, 2, 2, 2)
    assert check_logits_calls([a, b], engine) is None
    with pytest.raises(PrecisionError, match="other batches than assumed"):
        row_plans([a, b], {**engine, "logits_calls": [[0, 9]]})
    rows = EngineRows.of([plan_a, plan_b], SOME_ORDER)  # a padded batch: rows past a sequence's end are 0 (never computed)
    assert rows.body.tolist() == [[9] * 6 + [2, 2], [9] * 3 + [2, 2, 0, 0, 0]]
    assert rows.logits.tolist() == [[5] * 5 + [2, 2, 0], [2, 2, 2, 2, 0, 0, 0, 0]]
    assert RowPlan((9, 2), (9,)).tensors()[1].tolist() == [[9, 0]]
    # each row's index in the forward that computed it, and in its logits call (its prompt's, or the step's sampling call)
    assert plan_a.body_at == (0, 1, 2, 3, 4, 5, 0, 0) and plan_b.body_at == (6, 7, 8, 1, 1)
    assert plan_a.logits_at == (0, 1, 2, 3, 4, 0, 0) and plan_b.logits_at == (0, 1, 1, 1)
    assert rows.body_at is not None and rows.body_at.tolist() == [[0, 1, 2, 3, 4, 5, 0, 0], [6, 7, 8, 1, 1, 0, 0, 0]]


def test_row_plans_follow_prefix_cache_hits_and_prompt_chunks_in_one_step() -> None:
    """As vLLM at its defaults schedules G samples with a token budget: sample a computes its 20-token prompt, sample b
    (the same prompt) only rows 16-19 in the same step (its first block a prefix-cache hit on a's), prompt c is cut
    into chunks of 10 + 20 rows. Logits: one row per request that fed rows in the step (c's first chunk too, its
    token discarded), never one for b's cached rows."""
    prompt = tuple(range(1, 21))
    a, b = SimpleNamespace(tokens=(*prompt, 50, 51), prompt_len=20), SimpleNamespace(tokens=(*prompt, 60, 61), prompt_len=20)
    c = SimpleNamespace(tokens=(*range(100, 130), 70), prompt_len=30)
    step0 = [(r, t) for r, t in enumerate(prompt)] + [(r, prompt[r]) for r in range(16, 20)] + [(r, 100 + r) for r in range(10)]
    step1 = [(20, 50), (20, 60)] + [(r, 100 + r) for r in range(10, 30)]
    engine = {"steps": [step0, step1, [(21, 51), (21, 61)]], "logits_calls": [[0, 3], [1, 3], [2, 2]], "prompt_logprobs": False}
    assert check_logits_calls([a, b, c], engine) is None
    plan_a, plan_b, plan_c = row_plans([a, b, c], engine)
    assert plan_b.body == (34,) * 20 + (22, 2)  # rows 0-15 read from a's computation: the same step's call
    assert plan_a.logits[19:] == (3, 3) and plan_b.logits[19:] == (3, 3) and plan_c.logits[29:] == (3,)
    assert plan_b.body_at == (*range(16), 20, 21, 22, 23, 1, 1)  # the cached rows at their place in a's request
    assert plan_c.body_at == (*range(24, 34), *range(2, 22), 0)
    assert plan_a.logits_at[19:] == (0, 0) and plan_b.logits_at[19:] == (1, 1) and plan_c.logits_at[29:] == (2,)
    stale = {**engine, "logits_calls": [[0, 4], [1, 3], [2, 2]]}  # the old plan's count: b's cached rows as a request
    assert "other batches than assumed" in (check_logits_calls([a, b, c], stale) or "")


def test_rows_are_matched_as_whole_requests_not_token_by_token() -> None:
    """Prompt y holds prompt x's token at position 5: sample b of x, whose row 5 is a prefix-cache hit, must not take
    y's row 5 for its own (y then had a row no step fed)."""
    x = tuple(range(1, 21))
    y = (*range(101, 106), x[5], *range(107, 121))
    a, b, c = (SimpleNamespace(tokens=(*x, 7), prompt_len=20), SimpleNamespace(tokens=(*x, 8), prompt_len=20),
               SimpleNamespace(tokens=(*y, 9), prompt_len=20))  # fmt: skip
    step0 = [(r, t) for r, t in enumerate(x)] + [(r, x[r]) for r in range(16, 20)] + [(r, t) for r, t in enumerate(y)]
    found = steps_of([a, b, c], [step0])
    assert found[2][:20] == [0] * 20 and found[1][:20] == [0] * 20 and found[0][:20] == [0] * 20
    assert check_logits_calls([a, b, c], {"steps": [step0], "logits_calls": [[0, 3]], "prompt_logprobs": False}) is None


def test_a_prefix_cache_hit_takes_its_keys_as_the_request_that_computed_the_row() -> None:
    """Sample b of a 600-token prompt feeds rows 592-599 only (its first 37 blocks hit sample a's, computed in the same
    step): b's own rows take their keys as b's request (8 query rows), the rows it read as a's request (600)."""
    from fx_precision.contract.attention_tiles import KvTiling

    tiling = KvTiling("vec", 1 << 20, 128, 16, 8, 2, True)
    prompt = tuple(range(1, 601))
    a, b = SimpleNamespace(tokens=(*prompt, 7), prompt_len=600), SimpleNamespace(tokens=(*prompt, 9), prompt_len=600)
    step0 = [(r, t) for r, t in enumerate(prompt)] + [(r, prompt[r]) for r in range(592, 600)]
    engine = {"steps": [step0], "logits_calls": [[0, 2]], "prompt_logprobs": False}
    _, plan_b = row_plans([a, b], engine, tiling=tiling)
    own, read = tiling.query_row_tiles([(600, 600), (8, 600)])[::-1]
    assert plan_b.kv_tiles is not None
    assert plan_b.kv_tiles[592:600] == tuple(own) and plan_b.kv_tiles[:592] == tuple(read[:592])
    assert tuple(own) != tuple(read[592:600])  # the two requests part there: the plan must know which one computed a row


def test_requests_of_one_shape_in_a_step_take_their_keys_each_as_its_own() -> None:
    """G samples of a prompt feed the same rows (1408-1499 after a prefix-cache hit) in one step: the engine splits
    each request's keys by its place in the step's work, so sample c's rows are c's request's, not b's."""
    from fx_precision.contract.attention_tiles import KvTiling

    tiling = KvTiling("vec", 1 << 20, 128, 16, 8, 4, True)
    prompt = tuple(range(1, 1501))
    samples = [SimpleNamespace(tokens=(*prompt, 7 + i), prompt_len=1500) for i in range(4)]
    step0 = [(r, t) for r, t in enumerate(prompt)] + [(r, prompt[r]) for r in range(1408, 1500)] * 3
    engine = {"steps": [step0], "logits_calls": [[0, 4]], "prompt_logprobs": False}
    plans = row_plans(samples, engine, tiling=tiling)
    want = tiling.query_row_tiles([(1500, 1500)] + [(92, 1500)] * 3)
    assert want[2] != want[1]  # the engine's split differs between the same-shaped requests here
    for i in (1, 2, 3):
        assert plans[i].kv_tiles is not None and plans[i].kv_tiles[1408:1500] == tuple(want[i])


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

    from fx_precision.passes.rewrites.engine.eager_math import engine_eager_math

    torch.manual_seed(5)
    x, w, pos = (torch.randn(4096, 128) * 3).to(BF16), (torch.randn(128) * 0.1 + 1).to(BF16), torch.arange(4096).float()
    want = _rms_rotary_mlp(x, w, pos)
    rewritten: list[int] = []

    def backend(rewrite: bool):  # type: ignore[no-untyped-def]
        def compile_with(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
            if rewrite:
                rewritten.append(len(engine_eager_math(PORTABLE)(gm, None)))  # type: ignore[arg-type]
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
        linears = sum(isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2's: addmm
        assert counts.get("engine-linears", 0) == linears, (spec.name, linears, counts)  # every GEMM in its engine call's order
        norms = sum(type(m).__name__.endswith(("RMSNorm", "LayerNorm", "Norm")) for m in model.modules())
        assert counts.get("engine-eager-math", 0) >= norms, (spec.name, norms, counts)  # each norm's reduction kept eager
    moe = {"qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3", "qwen3-next"}
    assert set(refused) == ({"gemma2", "bloom", "cohere", "qwen3.5"} | moe) & chosen, sorted(refused)
    assert "FXP301 attention computed as matmul + softmax" in refused["gemma2"] and "at model.layers.0.self_attn" in refused["gemma2"]
    assert "FXP301 attention computed as matmul + softmax" in refused["bloom"] and "transformer.h.0.self_attention" in refused["bloom"]
    assert "rotary the contract does not follow" in refused["cohere"] and "rotate_half" in refused["cohere"]  # interleaved
    assert "rotary the contract does not follow" in refused["deepseek-v3"]  # MLA's written-out interleaved rotation
    assert "mixture-of-experts routing (topk)" in refused["qwen3-moe"] and "at model.layers.0.mlp" in refused["qwen3-moe"]
    assert "gdn at model.layers.0.linear_attn" in refused["qwen3.5"]  # a contract whose probe read no GatedDeltaNet form


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
@pytest.mark.parametrize(
    ("flags", "said"),
    [(("--top-p", "0"), "--top-p 0.0: a share of the probability in (0, 1], 1 for all"),
     (("--temperature", "0", "--top-k", "4"), "--temperature 0 is greedy: it draws the most likely token, so --top-k and --top-p")],
)  # fmt: skip
def test_sampler_settings_that_cannot_hold_are_one_line_before_the_engine(
    flags: tuple[str, ...], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fx_precision.tools.checkpoint import write_tiny_checkpoint
    from fx_precision.tools.cli import main

    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt")
    capsys.readouterr()  # the checkpoint writer's progress
    assert main(["rollout", "--model", str(checkpoint), *flags, "--out", str(tmp_path / "dump")]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "dump").exists()


@pytest.mark.needs_transformers
def test_training_under_the_contract_on_two_gloo_ranks() -> None:
    """FSDP2 on 2 gloo ranks, compiled whole with the contract's rewrites: the loss falls, masters and their
    gradients stay fp32, and the first step's gradients are within 5% (relative L2, every parameter) of the
    same run without the contract (plain bf16 gather and autocast): the rewrites change roundings, not the model.
    Measured on tiny Qwen3 (torch 2.13.0+cpu, Sapphire Rapids): worst 1.7e-2 (a k_norm weight), median 8.9e-3,
    the bf16 rounding level; losses over 4 steps agree to 1e-3."""
    from fx_precision.ranks import run_on_ranks
    from tests import fsdp_workers

    runs = [("contract_training", ("qwen3", PORTABLE.to_dict(), 4)), ("contract_training", ("qwen3", None, 1))]
    ((under, plain),) = [r for r in run_on_ranks(fsdp_workers.in_turn, 2, runs) if r]
    # one decoder-layer graph serves every layer (the same code, compiled once); FSDP2 units break the graph between
    # layers, so the fused add + norm is kept across the break (the sum leaving one graph, taken by the next one's norm)
    # eager math: the layer graph's 4 norms' means and silu, the final norm's, the rotary table's cos and sin
    rewrites = {"engine-gdn": 0, "engine-moe": 0, "fused-add-norm": 4, "engine-rotary": 2, "engine-attention": 1, "engine-linears": 8,
                "engine-eager-math": 8, "engine-logits": 0, "engine-coverage": 0}  # fmt: skip
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

    from fx_precision.engines.vllm.probes import checkpoint_weights
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


@pytest.mark.needs_transformers
def test_a_recompute_under_the_contract_gives_the_same_bits_or_is_refused_in_one_line() -> None:
    """Activation checkpointing under the contract: each decoder layer compiled alone and checkpointed around (its
    forward runs again in backward) gives the gradients of the run without checkpointing bit for bit, with the
    backward inside engine_rows (the recompute reads the forward's row plan and residual sums again); outside it the
    recompute refuses in one line; a whole-model compile that traces the checkpointed layers into nested graphs is
    refused in one line (the pass does not rewrite inside them)."""
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fx_precision.backend import make_precision_backend
    from fx_precision.contract.linear_order import engine_linear_shapes

    config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=64)  # fmt: skip
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    rows = torch.full((1, 12), 12, dtype=torch.int32)

    def run(checkpointed: bool, backward_inside: bool = True) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).train()
        orders = LinearOrders.uniform(engine_linear_shapes(model, input_ids=ids[:, :4]), [12], lambda k: candidate_orders(k, 1)[0])
        contract = EngineContract(attention=AttentionArithmetic() if engine_kernels().cpu_has_amx() else VEC, linears=orders)
        policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=contract)
        backend = make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager")
        for layer in model.model.layers:  # each block compiled alone, checkpointed around the compiled block
            compiled = torch.compile(layer.forward, backend=backend)
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(compiled) if checkpointed else compiled
        with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            loss = model(input_ids=ids, use_cache=False).logits.float().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = run(False), run(True)
    assert plain.keys() == recomputed.keys() and all(torch.equal(plain[n], recomputed[n]) for n in plain)
    with pytest.raises(PrecisionError, match=r"ran outside fx_precision\.contract\.batch_rows\.engine_rows.*a recompute in backward"):
        run(True, backward_inside=False)

    def whole_model(checkpointing: str) -> tuple[Any, Any, LinearOrders, Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).train()
        if checkpointing == "none":
            pass
        elif checkpointing == "transformers":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:  # each MLP checkpointed inside the compiled model: Dynamo traces its body into a nested graph
            for layer in model.model.layers:
                layer.mlp.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(layer.mlp.forward)
        orders = LinearOrders.uniform(engine_linear_shapes(model, input_ids=ids[:, :4]), [12], lambda k: candidate_orders(k, 1)[0])
        policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False,
                                     contract=EngineContract(attention=VEC, linears=orders))  # fmt: skip
        whole = torch.compile(model, backend=make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager"))
        return model, whole, orders, policy

    model, whole, orders, policy = whole_model("inside")
    with pytest.raises(Exception, match=r"holds a nested graph.*does not rewrite"):  # Dynamo wraps the backend's PrecisionError
        with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            whole(input_ids=ids, use_cache=False)
    # transformers' own checkpointing under a whole-model compile: traced into nested graphs (refused as above), or
    # skipped by Dynamo and run eagerly where the layer's code breaks the graph inside the checkpoint (transformers >= 5.25
    # with the kernels package): refused too; a run that is not refused gives the unchecked run's logits and gradients
    model, whole, orders, policy = whole_model("none")
    with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
        whole_logits = whole(input_ids=ids, use_cache=False).logits
        whole_logits.float().sum().backward()
    plain = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model, whole, orders, policy = whole_model("transformers")
    try:
        with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            logits = whole(input_ids=ids, use_cache=False).logits
            logits.float().sum().backward()
    except Exception as refused:  # Dynamo wraps the backend's PrecisionError
        assert re.search(r"(holds a nested graph.*does not rewrite|could not trace a checkpointed block.*outside the pass)", str(refused))
    else:
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert torch.equal(logits, whole_logits)
        assert grads.keys() == plain.keys() and all(torch.equal(plain[n], grads[n]) for n in plain)
