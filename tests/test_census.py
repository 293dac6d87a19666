"""The eager census: non-intrusive hooks, nested outputs, diff; and its FSDP2 driver."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fx_precision.census import Census, CensusRecorder, census
from fx_precision.tools.toy_decoder import ToyDecoder
from tests.cli import run_cli


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_census_leaves_outputs_and_gradients_bit_identical() -> None:
    torch.manual_seed(0)
    model = ToyDecoder()
    ids = torch.randint(0, 128, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids)
    plain.float().sum().backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = census(model, ids, backward=True)
        again = model(ids)
    assert torch.equal(again, plain)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain_grads[n]), n
    assert _hooks(model) == 0
    grads = [e for e in result.entries if e.direction.startswith("grad")]
    forward = {(e.module, e.call, e.direction, e.path): e for e in result.entries}
    assert grads  # a gradient is recorded per float tensor that requires grad, at that tensor's dtype and shape
    for g in grads:
        twin = forward[(g.module, g.call, g.direction.removeprefix("grad_"), g.path)]
        assert (g.dtype, g.shape) == (twin.dtype, twin.shape), g
    assert result.count("int64") == 3  # the token ids into the root, the backbone and the embedding


def test_hooks_are_removed_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inner(x)
            raise RuntimeError("boom")

    model = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        census(model, torch.randn(1, 2))
    assert _hooks(model) == 0
    with pytest.raises(RuntimeError, match="boom"), CensusRecorder(model):
        model(torch.randn(1, 2))
    assert _hooks(model) == 0


def test_nested_outputs_are_walked_with_paths() -> None:
    class Nested(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, object]:
            return {"a": (x, [x.long()]), "b": {"c": x * scale}}

    c = census(Nested(), torch.randn(2), scale=torch.ones(2, dtype=torch.float64))
    paths = {(e.direction, e.path, e.dtype) for e in c.entries}
    assert ("in", "kwargs.scale", "fp64") in paths
    assert ("out", "out.a[1][0]", "int64") in paths
    assert ("out", "out.b.c", "fp64") in paths


def test_diff_lists_modules_whose_dtypes_changed_and_json_round_trips() -> None:
    torch.manual_seed(0)
    model = ToyDecoder()
    ids = torch.randint(0, 128, (1, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        leaky = census(model, ids)
    model.model.embed_tokens.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        clean = census(model, ids)
    assert clean.count("fp32") == 0 and leaky.count("fp32") > 0
    changed = {row["module"] for row in leaky.diff(clean)}
    assert "model.embed_tokens" in changed and "model.layers.0.input_layernorm" in changed
    assert "model.layers.0.self_attn.q_proj" in changed  # its input was fp32, now bf16
    assert Census.from_dict(json.loads(leaky.to_json())).entries == leaky.entries
    assert leaky.diff(leaky) == []


@pytest.mark.needs_transformers
def test_demo_json_reproduces_the_qwen3_5_finding() -> None:
    out = run_cli("demo", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["policy"]: r for r in json.loads(out.stdout)["rows"]}
    for leaky in ("as-is", "re-cast off only", "embedding bf16 only"):
        assert rows[leaky]["fp32"] > 0, leaky
    both = rows["both fixes"]
    assert both["fp32"] == 0 and both["bf16"] == both["float_tensors"] > 0
    assert set(both["totals"]) == {"bf16", "int64"}
    assert all(p.endswith(("input_ids", "position_ids", "args[0]", "args[1]")) for p in both["int64_paths"])
    assert {p.split(":")[0] for p in both["int64_paths"] if p.endswith("args[1]")} == {"model.rotary_emb"}  # position ids
    assert rows["default (no autocast)"]["bf16"] == 0


@pytest.mark.needs_transformers
def test_default_policy_census_equals_plain_per_layer_fully_shard() -> None:
    from fx_precision.tools.census_driver import CensusConfig, run_census

    ours = CensusConfig(label="default", compute=None)
    plain = CensusConfig(label="plain", compute=None, plain_wrap=True)
    (_, _, a), (_, _, b) = run_census([ours, plain], world_size=1)
    assert a.entries == b.entries
    assert a.count("fp32") > 0 and a.count("bf16") == 0


@pytest.mark.needs_transformers
def test_census_on_two_ranks_counts_like_one_rank() -> None:
    one = run_cli("census", "--model", "qwen3_5-tiny", "--gather", "fp32", "--compute", "bf16", "--json")
    two = run_cli("census", "--model", "qwen3_5-tiny", "--gather", "fp32", "--compute", "bf16", "--world-size", "2", "--json")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert a["totals"] == b["totals"] and a["totals"]["fp32"] > 0
    assert a["world_size"] == 1 and b["world_size"] == 2
    table = run_cli("census", "--model", "qwen3_5-tiny", "--world-size", "2")
    assert table.returncode == 0 and table.stdout.count("module-IO tensors:") == 1  # rank 0 alone prints


@pytest.mark.needs_transformers
def test_census_cli_reports_a_bad_rule_from_inside_the_ranks_without_a_traceback() -> None:
    out = run_cli("census", "--model", "qwen3_5-tiny", "--rules", "*embed_tokenz=bf16", "--world-size", "2")
    assert out.returncode == 2
    assert "*embed_tokenz=bf16" in out.stderr and "model.embed_tokens" in out.stderr
    assert "Traceback" not in out.stderr
