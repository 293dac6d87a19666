"""One engine preflight (engines/preflight.py) for the rollout, the engine server and the on-policy loop: the same bad
input is refused by each in the same words, before an engine starts; what only training refuses (non-finite weights,
route replay on a dense model) is the loop's alone. No engine runs here: every refusal comes before one would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fx_precision.engines.preflight import MAX_POSITIONS, engine_preflight
from fx_precision.errors import PrecisionError

pytestmark = pytest.mark.needs_transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fx_precision.tools.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("preflight") / "qwen3", seed=9)


def _refusals(checkpoint: Path, prompts: list[list[int]], max_tokens: int, tmp_path: Path) -> list[str]:
    """What the rollout, the engine server's start and the loop say about one set of prompts."""
    from fx_precision.engines import protocol
    from fx_precision.engines.adapter import RolloutConfig
    from fx_precision.engines.rollout import rollout_prompts
    from fx_precision.engines.serve import EngineServer
    from fx_precision.onpolicy.config import OnPolicyConfig, Sampling
    from fx_precision.onpolicy.loop import preflight

    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    said = []
    tupled = tuple(tuple(p) for p in prompts)
    calls = (
        lambda: rollout_prompts(str(checkpoint), str(tmp_path / "prompts.json"), (), 0, max_tokens, "vllm"),
        lambda: EngineServer().op_start(protocol.Start.of(RolloutConfig(str(checkpoint), tupled, max_tokens=max_tokens))),
        lambda: preflight(OnPolicyConfig(str(checkpoint), str(tmp_path / "run"), sampling=Sampling(prompts=tupled, max_tokens=max_tokens))),
    )
    for call in calls:
        with pytest.raises(PrecisionError) as refused:
            call()
        said.append(str(refused.value))
    return said


def test_the_rollout_the_server_and_the_loop_refuse_bad_prompts_in_one_wording(checkpoint: Path, tmp_path: Path) -> None:
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    outside = _refusals(checkpoint, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [5, vocab, 7, 8, 9, 10, 11, 12, 13]], 4, tmp_path)
    assert len(set(outside)) == 1 and f"token id {vocab} is outside the vocabulary" in outside[0], outside
    positions = engine_preflight(str(checkpoint), "vllm").positions
    assert positions <= MAX_POSITIONS
    long = _refusals(checkpoint, [[1] * positions], 8, tmp_path)
    assert len(set(long)) == 1 and str(positions) in long[0], long


def test_an_engine_that_only_reads_dumps_cannot_be_started(checkpoint: Path) -> None:
    with pytest.raises(PrecisionError, match=r"engine 'sglang': .*needs a live engine"):
        engine_preflight(str(checkpoint), "sglang", live=True)
    with pytest.raises(PrecisionError, match="no adapter; the engines are"):
        engine_preflight(str(checkpoint), "tgi")


def test_non_finite_weights_are_the_loops_refusal_and_the_rollouts_report(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("inf"))
    save_file(weights, str(broken / "model.safetensors"))
    checked = engine_preflight(str(broken), "vllm")  # a rollout runs them: its dump says the log-probs are not usable
    assert checked.vocab > 0 and checked.min_prompt_len >= 1
    with pytest.raises(PrecisionError, match=rf"--model {broken}: {name} holds \d+ NaN or Inf"):
        engine_preflight(str(broken), "vllm", live=True, finite=True)
