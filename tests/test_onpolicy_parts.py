"""The on-policy loop's parts that need no engine: the objective, the task, the certification, the micro-batches, the
run directory, the config's refusals and the plot. The loop itself runs against a live vLLM in
tests/engine/test_onpolicy.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fx_precision.dump import Sequence
from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.grpo import group_advantages, grpo_token_loss, ratio_stats
from fx_precision.onpolicy.loop import OnPolicyConfig, OnPolicyRun, StepData, StepMetrics, certify, micro_batches
from fx_precision.onpolicy.run_dir import RunDir
from fx_precision.onpolicy.task import TargetTokens


def test_group_advantages_centre_each_group_and_a_flat_group_gives_zero() -> None:
    a = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.2], group=2)
    assert a[0] > 0 > a[1] and abs(float(a[0] + a[1])) < 1e-6
    assert torch.equal(a[2:], torch.zeros(4))


def test_at_ratio_one_the_loss_gradient_is_the_policy_gradient() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    grpo_token_loss(lp, lp.detach(), adv).sum().backward()
    assert lp.grad is not None and torch.equal(lp.grad, -adv)  # d/dlp of -ratio * A at ratio 1
    stats = ratio_stats(lp.detach(), lp.detach())
    assert stats == {"ratio_min": 1.0, "ratio_max": 1.0, "k3_kl": 0.0}


def test_the_ratio_is_clipped_where_the_advantage_would_push_it_further() -> None:
    train = torch.tensor([0.5], requires_grad=True)  # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient
    grpo_token_loss(train, torch.zeros(1), torch.ones(1)).sum().backward()
    assert train.grad is not None and float(train.grad) == 0.0


def test_the_task_rewards_the_share_of_target_ids() -> None:
    task = TargetTokens(4)
    assert task.reward([0, 4, 5, 7]) == 0.5 and task.reward([]) == 0.0
    with pytest.raises(PrecisionError, match="modulus"):
        TargetTokens(1)


def _data(values: list[list[float]], prompt_len: int = 3) -> StepData:
    sequences = [Sequence(tuple(range(len(v) + 1)), prompt_len) for v in values]
    return StepData(sequences, [torch.tensor(v) for v in values])


def test_certification_compares_bit_patterns_and_names_the_first_mismatch() -> None:
    data = _data([[-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, 0.0, -4.0]])
    same = {0: data.logprobs[0].clone(), 1: data.logprobs[1].clone()}
    found = certify(data, same, same)
    assert found["mismatches"] == 0 and found["tokens"] == 4 and found["prompt_tokens"] == 4 and found["ratio_min"] == 1.0
    negative_zero = {0: same[0], 1: torch.tensor([-1.0, -2.0, -0.0, -4.0])}  # equal as floats, not as bits
    found = certify(data, same, negative_zero)
    assert found["mismatches"] == 1 and found["forward_mismatches"] == 1 and found["recompute_mismatches"] == 0
    assert found["first"]["sequence"] == 1 and found["first"]["token"] == 3 and found["max_delta"] == 0.0
    drifted = {0: torch.tensor([-1.0, -2.0, -3.5, -4.0]), 1: same[1]}  # the trainer drifted from the rollout, consistently
    found = certify(data, drifted, drifted)
    assert found["mismatches"] == found["recompute_mismatches"] == 1 and found["forward_mismatches"] == 0
    assert found["first"] == {"sequence": 0, "token": 3, "token_id": 3, "rollout": -3.0, "recompute": -3.5, "first_forward": -3.5}
    assert found["max_delta"] == 0.5 and found["ratio_min"] < 1.0
    found = certify(data, {0: torch.tensor([-1.5, -2.0, -3.0, -4.0]), 1: same[1]}, same)  # a prompt token: counted apart
    assert found["prompt_mismatches"] == 1 and found["mismatches"] == 0 and found["first"] is None


def test_every_rank_gets_the_same_number_of_fixed_shape_micro_batches() -> None:
    data = _data([[-1.0] * 5] * 5)  # 5 sequences of 6 tokens over 2 ranks, 2 rows each
    shapes = []
    for rank in (0, 1):
        batches = micro_batches(data, None, None, rank, 2, 2, 8)
        shapes.append([tuple(b.ids.shape) for b in batches])
        assert [i for b in batches for i in b.index if i >= 0] == list(range(rank, 5, 2))
        assert all(b.index.count(-1) == 2 - len([i for i in b.index if i >= 0]) for b in batches)
    assert shapes[0] == shapes[1] == [(2, 8), (2, 8)]


def test_the_run_directory_moves_last_only_to_a_complete_step(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run", overwrite=False, sources=())
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    for step in (0, 1):
        staging = run.staging(step)
        assert not run.last.exists() or run.last.resolve().name == f"{step - 1:04d}"  # the previous step until committed
        run.write_checkpoint(staging, weights, str(tmp_path))
        run.commit(step, staging)
    assert os.readlink(run.last) == "steps/0001" and sorted(p.name for p in (run.root / "steps").iterdir()) == ["0001"]
    run.write_metrics({"steps": []})
    with pytest.raises(PrecisionError, match="--overwrite"):
        RunDir.create(run.root, overwrite=False, sources=())
    with pytest.raises(PrecisionError, match="sits inside"):
        RunDir.create(tmp_path / "ckpt" / "run", overwrite=False, sources=(str(tmp_path / "ckpt"),))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("samples", 0, "--samples 0"), ("steps", 0, "--steps 0"), ("contract", "sglang", "--contract"), ("mode", "loose", "--mode"),
     ("lr", 0.0, "--lr"), ("micro_batch", True, "--micro-batch")],
)  # fmt: skip
def test_a_bad_config_is_one_error_naming_the_flag(field: str, value: object, needle: str) -> None:
    with pytest.raises(PrecisionError, match=needle.replace("-", r"\-")):
        OnPolicyConfig(checkpoint="ckpt", out="out", **{field: value})  # type: ignore[arg-type]


def test_greedy_sampling_of_a_group_is_refused_before_an_engine_starts() -> None:
    from fx_precision.engines.adapter import RolloutConfig

    with pytest.raises(PrecisionError, match="--temperature 0 is greedy"):
        OnPolicyConfig(checkpoint="ckpt", out="out", temperature=0.0, samples=4)
    with pytest.raises(PrecisionError, match="--samples 3 would repeat it"):
        RolloutConfig(model="ckpt", prompts=((1, 2, 3, 4, 5),), temperature=0.0, samples=3)
    assert OnPolicyConfig(checkpoint="ckpt", out="out", temperature=0.0, samples=1).samples == 1


def test_the_plot_draws_reward_and_mismatch_per_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the dev and plot extras install it)")
    from fx_precision.onpolicy.report import plot, summary_line, table

    steps = [StepMetrics(i, 16, 128, m, m, 0, 0, 96, 0.01 * m, 1.0, 1.0, 0.0, 0.25 + 0.05 * i, 0.0, f"f{i}", f"w{i}", {"step": 0.5})
             for i, m in enumerate((0, 3, 0, 0, 0, 0))]  # fmt: skip
    run = OnPolicyRun({"contract": "vllm", "samples": 4, "temperature": 1.0, "world_size": 2}, {}, None, steps)
    out = plot([("--contract vllm", run)], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = summary_line(run)
    assert "5 of 6 steps without a mismatch" in line and "0.300 (first 3 steps) -> 0.450 (last 3)" in line
    assert table(run).count("\n") == 7  # header, rule, six steps
    with pytest.raises(PrecisionError, match=r"a \.png file"):
        plot([("x", run)], tmp_path / "p.svg")
