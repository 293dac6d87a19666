"""The backend's casts as module hooks: the precision fix for forwards that run (partly) eagerly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fx_precision as fxp
from fx_precision.errors import PrecisionError
from tests import lint_models as lm

BF16 = torch.bfloat16
POLICY = fxp.PrecisionPolicy(compute=BF16)
CONFIGS = Path(__file__).parent / "configs"


def _hooks_state(model: nn.Module) -> list[tuple[str, int, int]]:
    return [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()]


def test_the_masked_norm_and_the_embedding_become_output_hooks_with_the_backends_numbers() -> None:
    torch.manual_seed(0)
    model = lm.EmbedLlamaNorm()
    ids = torch.randint(0, 32, (2, 4))
    fix = fxp.eager_casts(model, ids, policy=POLICY)
    assert [(h.modules, h.path, h.frm, h.to, h.kind, h.exact) for h in fix.hooks] == [
        ("embed", "out", torch.float32, BF16, "source-output", True),
        ("norm", "out", torch.float32, BF16, "source-output", True),
    ]
    assert fix.hooks[1].fixes.startswith("FXP002 weight-promotion at norm, masked by")
    with torch.autocast("cpu", dtype=BF16):
        compiled = torch.compile(model, backend=fxp.make_precision_backend(inner="aot_eager"))(ids)
        with fix.apply(model):
            eager = model(ids)
    assert torch.equal(eager, compiled) and eager.dtype == BF16


def test_a_model_with_nothing_to_fix_gets_no_hooks_and_remove_restores_it() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    assert fxp.eager_casts(plain, torch.randn(2, 16), policy=POLICY).hooks == []
    model = lm.EmbedLlamaNorm()
    ids = torch.randint(0, 32, (2, 4))
    before_hooks, before_params = _hooks_state(model), copy.deepcopy(model.state_dict())
    with torch.autocast("cpu", dtype=BF16):
        want = model(ids)
        fix = fxp.eager_casts(model, ids, policy=POLICY).apply(model)
        assert model(ids).dtype == BF16
        fix.remove()
        got = model(ids)
    assert _hooks_state(model) == before_hooks and torch.equal(got, want)
    assert all(torch.equal(v, before_params[k]) for k, v in model.state_dict().items())
    with pytest.raises(PrecisionError, match="applied already"):
        fix.apply(model).apply(model)
    fix.remove()


def test_gpt2_position_embedding_is_hooked_where_it_has_one_use() -> None:
    torch.manual_seed(0)
    model = lm.AbsolutePositions()
    ids = torch.randint(0, 32, (2, 8))
    fix = fxp.eager_casts(model, ids, policy=POLICY)
    assert {(h.modules, h.kind) for h in fix.hooks} == {("wte", "source-output"), ("wpe", "source-operand")}
    with torch.autocast("cpu", dtype=BF16):
        compiled = torch.compile(model, backend=fxp.make_precision_backend(inner="aot_eager"))(ids)
        with fix.apply(model):
            assert torch.equal(model(ids), compiled)


def test_hooks_hold_under_activation_checkpointing() -> None:
    torch.manual_seed(0)

    class Checkpointed(lm.EmbedLlamaNorm):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            return self.head(checkpoint(self.norm, h, use_reentrant=False))

    model = Checkpointed()
    ids = torch.randint(0, 32, (2, 4))
    fix = fxp.eager_casts(model, ids, policy=POLICY)
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        with fix.apply(model), torch.autocast("cpu", dtype=BF16):
            out = model(ids) if recompute else lm.EmbedLlamaNorm.forward(model, ids)
            out.float().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert {g.dtype for g in grads[1].values()} == {torch.float32}


@pytest.mark.needs_transformers
def test_hooks_derived_on_a_full_size_meta_config_work_on_the_small_model_of_the_family() -> None:
    from fx_precision.tools.arch_zoo import arch
    from fx_precision.tools.zoo import build_model

    big = build_model(str(CONFIGS / "llama-3-8b"), device="meta")
    fix = fxp.eager_casts(big, input_ids=torch.zeros(1, 8, dtype=torch.long), policy=POLICY, use_cache=False)
    assert {h.modules for h in fix.hooks} == {
        "model.embed_tokens",
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.norm",
    }
    small = arch("llama").build()  # 2 layers, hidden 32
    ids = torch.randint(0, 256, (2, 8))
    torch._dynamo.reset()  # this worker's earlier tests' compiled Llama frames: a freed backend's id can be reused by this one
    with torch.autocast("cpu", dtype=BF16):
        compiled = torch.compile(small, backend=fxp.make_precision_backend(inner="aot_eager"))(input_ids=ids).logits
        with fix.apply(small):
            eager = small(input_ids=ids).logits
    assert torch.equal(eager, compiled)


@pytest.mark.needs_transformers
@pytest.mark.parametrize("arch_name", ["mistral", "qwen3-tied"])
def test_per_block_compile_under_fsdp2_gets_the_whole_model_stream_with_the_hooks(arch_name: str) -> None:
    from fx_precision.ranks import run_on_ranks
    from tests import fsdp_workers

    runs = [("per_block_eager_fix", (arch_name, False)), ("per_block_eager_fix", (arch_name, True))]
    ((plain, fixed),) = [r for r in run_on_ranks(fsdp_workers.in_turn, 2, runs) if r]
    # as-is, every block graph receives the eager embedding's fp32 residual stream, and says where it came from
    assert all(n > 0 for n in plain["block_fp32_stream"])
    assert plain["wide_inputs"] and all("made outside this graph" in m and "eager_casts" in m for m in plain["wide_inputs"])
    # with the hooks, each block sees what a whole-model compile sees: no fp32 stream tensor at all
    assert fixed["hooks"] > 0 and fixed["block_fp32_stream"] and set(fixed["block_fp32_stream"]) == {0}
    assert fixed["wide_inputs"] == [] and fixed["grad_dtypes"] == ["torch.float32"]
