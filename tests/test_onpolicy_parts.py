"""The on-policy loop's parts that need no engine: the objective, the task, the certification, the micro-batches, the
run directory, the config's refusals and the plot. The loop itself runs against a live vLLM in
tests/engine/test_onpolicy.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from fx_precision.dump import Sequence
from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.batches import StepData, micro_batches
from fx_precision.onpolicy.config import EngineLaunch, OnPolicyConfig, Sampling, Training
from fx_precision.onpolicy.grpo import group_advantages, grpo_token_loss, ratio_stats
from fx_precision.onpolicy.metrics import STANDARD_NAMES, Certificate, FirstMismatch, OnPolicyRun, StepMetrics, certify
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
    assert stats == {"ratio_min": 1.0, "ratio_mean": 1.0, "ratio_max": 1.0, "k1_kl": 0.0, "k3_kl": 0.0}


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
    assert found.mismatches == 0 and found.tokens == 4 and found.prompt_tokens == 4 and found.ratio_min == 1.0
    negative_zero = {0: same[0], 1: torch.tensor([-1.0, -2.0, -0.0, -4.0])}  # equal as floats, not as bits
    found = certify(data, same, negative_zero)
    assert found.mismatches == 1 and found.forward_mismatches == 1 and found.recompute_mismatches == 0
    assert found.first is not None and found.first.sequence == 1 and found.first.token == 3 and found.max_delta == 0.0
    drifted = {0: torch.tensor([-1.0, -2.0, -3.5, -4.0]), 1: same[1]}  # the trainer drifted from the rollout, consistently
    found = certify(data, drifted, drifted)
    assert found.mismatches == found.recompute_mismatches == 1 and found.forward_mismatches == 0
    assert found.first == FirstMismatch(0, 3, 3, -3.0, -3.5, -3.5)
    assert found.max_delta == 0.5 and found.mean_delta == 0.125 and found.ratio_min < 1.0 and found.max_prob_delta > 0
    found = certify(data, {0: torch.tensor([-1.5, -2.0, -3.0, -4.0]), 1: same[1]}, same)  # a prompt token: counted apart
    assert found.prompt_mismatches == 1 and found.mismatches == 0 and found.first is None


def test_a_nan_is_never_equal_and_a_step_that_saw_one_learned_nothing() -> None:
    """NaN log-probs with the same bit pattern on every side are still mismatches, counted as non-finite; the step that
    saw one is not learned, its reward leaves the run's trend, and the table says why instead of a reward."""
    nan = float("nan")
    data = _data([[-1.0, -2.0, nan, -4.0]])
    found = certify(data, {0: data.logprobs[0].clone()}, {0: data.logprobs[0].clone()})
    assert found.non_finite == 1 and found.mismatches == 1 and found.max_delta == 0.0
    learned = StepMetrics(0, 1, found, 0.25, 0.1, "f", "w", {"step": 1.0})
    broken = StepMetrics(1, 1, found, 1.0, nan, "f", "w", {"step": 1.0}, non_finite="1 of 2 sampled log-probs, the loss")
    run = OnPolicyRun({"contract": "none"}, None, None, [learned, broken])
    assert learned.learned and not broken.learned
    assert run.summary()["reward_last3"] == 0.25 and run.summary()["non_finite_steps"] == 1
    assert broken.row()["reward"].startswith("not finite: 1 of 2 sampled log-probs")


def test_the_json_speaks_the_rl_frameworks_names_beside_its_own() -> None:
    found = certify(_data([[-1.0, -2.0, -3.0]]), {0: torch.tensor([-1.0, -2.0, -3.5])}, {0: torch.tensor([-1.0, -2.0, -3.5])})
    step = StepMetrics(0, 1, found, 0.5, 0.0, "f", "w", {"step": 1.0}).to_dict()
    assert step["standard"]["sampling/sampling_logp_difference/max"] == step["max_delta"] == 0.5
    assert step["standard"]["train/train_rollout_logprob_abs_diff"] == step["mean_delta"]
    assert step["standard"]["rollout_corr/k3_kl"] == step["k3_kl"] and set(step["standard"]) == set(STANDARD_NAMES)
    assert step["mismatches"] == 1 and step["first_mismatch"]["token"] == 3
    three = certify(_data([[-1.0, -2.0, -3.0]], prompt_len=1), {0: torch.tensor([-1.0, -2.0, -3.5])}, {0: torch.tensor([-1.0, -2.0, -3.5])})
    step = StepMetrics(0, 1, three, 0.5, 0.0, "f", "w", {"step": 1.0}).to_dict()
    ratios = torch.tensor([1.0, 1.0, math.exp(-0.5)], dtype=torch.float64)  # p_train / p_rollout of the three sampled tokens
    standard = step["standard"]
    assert standard["sampling/importance_sampling_ratio/min"] == step["ratio_min"] == float(ratios.min())
    assert standard["sampling/importance_sampling_ratio/max"] == 1.0
    assert standard["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(ratios.mean()), rel=1e-12)
    assert standard["rollout_corr/kl"] == pytest.approx(0.5 / 3, rel=1e-6)  # mean of log p_rollout - log p_train
    probs = (torch.tensor([-3.5]).double().exp() - torch.tensor([-3.0]).double().exp()).abs()
    assert standard["training/rollout_probs_diff_std"] == pytest.approx(
        float(torch.cat([torch.zeros(2, dtype=torch.float64), probs]).std(unbiased=False))
    )
    from fx_precision.onpolicy.report import table

    run = OnPolicyRun({"contract": "none"}, None, None, [StepMetrics(0, 1, found, 0.5, 0.0, "f", "w", {"step": 1.0})])
    assert all(name in table(run) for name in STANDARD_NAMES)  # the CLI's table speaks them too


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
    weights = {"w": torch.ones(2, dtype=torch.bfloat16)}
    for step in (0, 1):
        staging = run.staging(step)
        assert not run.last.exists() or run.last.resolve().name == f"{step - 1:04d}"  # the previous step until committed
        run.write_checkpoint(staging, weights, str(tmp_path))
        run.commit(step, staging)
    assert os.readlink(run.last) == "steps/0001" and sorted(p.name for p in (run.root / "steps").iterdir()) == ["0001"]
    run.write_metrics({"steps": []})
    run.release()
    with pytest.raises(PrecisionError, match="--overwrite"):
        RunDir.create(run.root, overwrite=False, sources=())
    with pytest.raises(PrecisionError, match="sits inside"):
        RunDir.create(tmp_path / "ckpt" / "run", overwrite=False, sources=(str(tmp_path / "ckpt"),))


def test_one_run_per_directory_and_overwrite_never_replaces_a_live_one(tmp_path: Path) -> None:
    """A run holds DIR's lock while it runs: --overwrite of it is refused naming the live run's pid (nothing is deleted);
    once it ends, --overwrite replaces it. A run that completed no step leaves nothing; a killed writer's staging and
    temporary files are removed when the run ends."""
    live = RunDir.create(tmp_path / "run", overwrite=False, sources=())
    staging = live.staging(0)
    live.write_checkpoint(staging, {"w": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path))
    live.commit(0, staging)
    with pytest.raises(PrecisionError, match=rf"a live on-policy run \(pid {os.getpid()}\) is writing it"):
        RunDir.create(tmp_path / "run", overwrite=True, sources=())
    assert (live.root / "steps" / "0000").is_dir()  # the live run's step is untouched
    (live.root / "steps" / ".0001.writing-999999").mkdir()  # a writer killed mid-step
    (live.root / ".metrics.json.999999").write_text("{")
    live.release()
    assert not list((live.root / "steps").glob(".*")) and not (live.root / ".metrics.json.999999").exists()
    again = RunDir.create(tmp_path / "run", overwrite=True, sources=())
    assert not (again.root / "steps" / "0000").exists()
    again.engine_log.write_text("the engine's last words\n")
    again.release()  # no step completed: only the engine's log is kept, and the next run takes DIR without --overwrite
    assert sorted(p.name for p in again.root.iterdir()) == [".run.lock", "engine.log"]
    RunDir.create(tmp_path / "run", overwrite=False, sources=()).release()


def test_weights_files_of_owners_that_are_gone_are_removed(tmp_path: Path) -> None:
    from fx_precision.engines.weights_file import remove_stale, weights_file_name, write_weights

    mine = tmp_path / weights_file_name()
    write_weights({"w": torch.ones(3)}, mine)
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    stale = [tmp_path / f"fxp-engine-{dead}-0.safetensors", tmp_path / f".fxp-engine-{dead}-1.safetensors.writing"]
    for path in stale:
        path.write_bytes(b"x")
    other = tmp_path / "someone-else.safetensors"
    other.write_bytes(b"x")
    assert sorted(remove_stale(tmp_path)) == sorted(stale)
    assert mine.exists() and other.exists()


def test_a_checkpoint_with_non_finite_weights_is_found_tensor_by_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from fx_precision.checkpoints import non_finite_tensors

    head = torch.zeros(4, 8, dtype=torch.bfloat16)
    head[1, 2] = float("nan")
    head[3, 0] = float("inf")
    save_file({"lm_head.weight": head, "model.norm.weight": torch.ones(8, dtype=torch.bfloat16), "ids": torch.arange(3)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    assert non_finite_tensors(tmp_path) == [("lm_head.weight", 2, 32)]


@pytest.mark.parametrize(
    ("section", "field", "value", "needle"),
    [(Sampling, "samples", 0, "--samples 0"), (OnPolicyConfig, "steps", 0, "--steps 0"), (Training, "contract", "sglang", "--contract"),
     (OnPolicyConfig, "mode", "loose", "--mode"), (Training, "lr", 0.0, "--lr"), (Training, "micro_batch", True, "--micro-batch"),
     (EngineLaunch, "threads", -1, "--engine-threads -1"), (EngineLaunch, "launch", "fast", "--engine-launch 'fast'"),
     (Sampling, "max_tokens", 0, "--max-tokens 0")],
)  # fmt: skip
def test_a_bad_config_is_one_error_naming_the_flag(section: type, field: str, value: object, needle: str) -> None:
    """Each section checks its own fields when it is made, the run its own: one line naming the flag."""
    run = {"checkpoint": "ckpt", "out": "out"} if section is OnPolicyConfig else {}
    with pytest.raises(PrecisionError, match=needle.replace("-", r"\-")):
        section(**run, **{field: value})


def test_engine_calls_have_limits_from_what_they_are() -> None:
    from fx_precision.engines import protocol
    from fx_precision.engines.client import EngineTimeouts

    limits = EngineTimeouts(100.0)
    assert limits.of(protocol.LoadWeights("w")) == 100.0 and limits.of(protocol.Probe()) == 400.0
    assert limits.of(protocol.Generate([[1] * 600] * 4, 8, 1.0, 2)) == 100.0 + 0.05 * (608 * 4 * 2)
    with pytest.raises(PrecisionError, match=r"--engine-timeout 0\.5: seconds between 1 and 86400"):
        EngineTimeouts(0.5)


def test_the_engine_protocol_is_one_schema_both_ends_read_strictly() -> None:
    from fx_precision.engines import protocol
    from fx_precision.engines.adapter import RolloutConfig, SamplingRequest

    request = protocol.Generate.of(SamplingRequest(((1, 2, 3),), 4, 0.7, 2))
    assert protocol.decode_request(protocol.encode(request)) == request
    assert protocol.decode_request(protocol.encode(request)).sampling() == SamplingRequest(((1, 2, 3),), 4, 0.7, 2)
    start = protocol.Start.of(RolloutConfig(model="ckpt", prompts=((1, 2, 3, 4, 5),), isa="avx2"))
    assert protocol.decode_request(protocol.encode(start)).rollout_config().isa == "avx2"  # type: ignore[attr-defined]
    reply = protocol.encode(protocol.WeightsLoaded(0.5, "sha256:ab"))
    assert protocol.decode_reply(protocol.LoadWeights("w"), reply) == protocol.WeightsLoaded(0.5, "sha256:ab")
    with pytest.raises(PrecisionError, match=r"engine \(load_weights\): out of memory"):
        protocol.decode_reply(protocol.LoadWeights("w"), protocol.encode({"error": "out of memory"}))
    with pytest.raises(PrecisionError, match="unknown op 'fly'"):
        protocol.decode_request('{"op": "fly"}')
    with pytest.raises(PrecisionError, match=r"unknown field\(s\) \['colour'\]"):
        protocol.decode_request('{"op": "load_weights", "path": "w", "colour": 1}')
    with pytest.raises(PrecisionError, match="a reply to 'probe' where 'load_weights' was asked"):
        protocol.decode_reply(protocol.LoadWeights("w"), protocol.encode(protocol.Probed({}, 0.0, {})))


def test_greedy_sampling_of_a_group_is_refused_before_an_engine_starts() -> None:
    from fx_precision.engines.adapter import RolloutConfig

    with pytest.raises(PrecisionError, match="--temperature 0 is greedy"):
        Sampling(temperature=0.0, samples=4)
    with pytest.raises(PrecisionError, match="--samples 3 would repeat it"):
        RolloutConfig(model="ckpt", prompts=((1, 2, 3, 4, 5),), temperature=0.0, samples=3)
    assert OnPolicyConfig(checkpoint="ckpt", out="out", sampling=Sampling(temperature=0.0, samples=1)).sampling.samples == 1


def test_the_plot_draws_reward_and_mismatch_per_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the dev and plot extras install it)")
    from fx_precision.onpolicy.report import plot, summary_line, table

    def certificate(m: int) -> Certificate:
        return Certificate(128, m, m, 0, 96, 0, 0.01 * m, 0.001 * m, 0.0, 0.0, 1.0, 1.0, 0.0, 0)

    steps = [StepMetrics(i, 16, certificate(m), 0.25 + 0.05 * i, 0.0, f"f{i}", f"w{i}", {"step": 0.5})
             for i, m in enumerate((0, 3, 0, 0, 0, 0))]  # fmt: skip
    run = OnPolicyRun({"contract": "vllm", "samples": 4, "temperature": 1.0, "world_size": 2}, None, None, steps)
    out = plot([("--contract vllm", run)], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = summary_line(run)
    assert "5 of 6 steps without a mismatch" in line and "0.300 (first 3 steps) -> 0.450 (last 3)" in line
    own, standard = table(run).split("\n\n")
    assert own.count("\n") == standard.count("\n") == 7  # header, rule, six steps: the project's names, then the frameworks'
    with pytest.raises(PrecisionError, match=r"a \.png file"):
        plot([("x", run)], tmp_path / "p.svg")


def test_module_records_against_the_compiled_engine_are_refused_before_an_engine_starts() -> None:
    """vLLM at its defaults runs its model as one compiled graph, where module hooks never run: a dump of its modules would
    hold none, so --modules is refused there, naming the eager launch that records them."""
    from fx_precision.engines.adapter import RolloutConfig

    with pytest.raises(PrecisionError, match=r"--modules with --launch defaults: .*\(--launch eager\)$"):
        RolloutConfig(model="ckpt", prompts=((1, 2, 3),), modules=True, launch="defaults")
    with pytest.raises(PrecisionError, match=r"--modules with --engine-launch defaults: .*\(--engine-launch eager\)$"):
        OnPolicyConfig(checkpoint="ckpt", out="out", modules=True, sampling=Sampling(prompt_lens=(8,)))
    assert RolloutConfig(model="ckpt", prompts=((1, 2, 3),), modules=True, launch="eager").modules


def test_the_cli_and_the_python_api_launch_one_engine_by_default() -> None:
    """``fx-precision rollout`` with no launch flag and ``RolloutConfig`` with no launch field ask for the same engine: the
    engine's defaults (compiled, prefix caching), the machine's cores, no prompt log-probs; asked for eager, both give the
    diagnostic engine (one thread, prompt log-probs)."""
    from fx_precision.engines.adapter import RolloutConfig
    from fx_precision.tools.cli import build_parser, rollout_config

    prompts = ((1, 2, 3, 4, 5),)
    for flags, fields in (([], {}), (["--launch", "eager"], {"launch": "eager"}), (["--threads", "3"], {"threads": 3})):
        args = build_parser().parse_args(["rollout", "--model", "ckpt", "--out", "dump", *flags])
        assert rollout_config(args, prompts) == RolloutConfig(model="ckpt", prompts=prompts, **fields), flags
    api = RolloutConfig(model="ckpt", prompts=prompts)
    assert (api.launch, api.threads, api.prompt_logprobs) == ("defaults", os.cpu_count() or 1, False)
    eager = RolloutConfig(model="ckpt", prompts=prompts, launch="eager")
    assert (eager.threads, eager.prompt_logprobs) == (1, True)
    with pytest.raises(PrecisionError, match=r"--launch 'fast': one of defaults, eager"):
        RolloutConfig(model="ckpt", prompts=prompts, launch="fast")


def test_the_onpolicy_cli_and_its_python_api_run_one_loop_by_default() -> None:
    """``fx-precision onpolicy`` with no flags and ``OnPolicyConfig`` with no fields run the same loop: the engine at its
    defaults (the launch's own threads and split-KV), the trainer compiled by Inductor; asked for the diagnostic engine,
    both give it."""
    from fx_precision.onpolicy import OnPolicyConfig
    from fx_precision.tools.cli import build_parser, onpolicy_config

    eager = {"engine": EngineLaunch(launch="eager")}
    cases = (
        ([], {}),
        (["--engine-launch", "eager"], eager),
        (["--no-compiled", "--engine-launch", "eager"], {**eager, "training": Training(compiled=False)}),
    )
    for flags, fields in cases:
        args = build_parser().parse_args(["onpolicy", "--model", "ckpt", "--out", "run", *flags])
        assert onpolicy_config(args) == OnPolicyConfig(checkpoint="ckpt", out="run", **fields), flags  # type: ignore[arg-type]
    api = OnPolicyConfig(checkpoint="ckpt", out="run")
    assert (api.engine.launch, api.training.compiled, api.engine.threads) == ("defaults", True, 0)
    with pytest.raises(PrecisionError, match=r"--engine-launch defaults with --contract vllm: .* drop --no-compiled"):
        OnPolicyConfig(checkpoint="ckpt", out="run", training=Training(compiled=False))
    record = api.to_record()  # the run's JSON: one flat mapping of the flags' names
    assert (record["engine_launch"], record["samples"], record["contract"], record["engine"]) == ("defaults", 4, "vllm", "vllm")
