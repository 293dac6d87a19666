"""A Qwen3.5-MoE checkpoint laid out as Qwen3-Next (tools/gdn_layout.py): the same model, the same weights' identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fx_precision.checkpoints import weights_digest
from fx_precision.errors import PrecisionError
from fx_precision.tools.checkpoint import write_tiny_checkpoint
from fx_precision.tools.gdn_layout import relaid_digest, write_qwen3_next_layout

pytestmark = pytest.mark.needs_transformers


@pytest.mark.parametrize(("heads", "value_heads"), [(2, 4), (1, 3)])
def test_the_qwen3_next_layout_is_the_same_model_and_digests_as_the_relaid_weights(tmp_path: Path, heads: int, value_heads: int) -> None:
    """Held-out head counts (value heads a multiple of key heads, 1:2 and 1:3): HF's Qwen3.5-MoE on the source and HF's
    Qwen3-Next on the layout give the same fp32 logits bit for bit, and ``relaid_digest`` is the written layout's digest."""
    import transformers

    dims = {"linear_num_key_heads": heads, "linear_num_value_heads": value_heads, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
    source = write_tiny_checkpoint("qwen3.5-moe", tmp_path / "src", seed=heads, dims=dims)
    layout = write_qwen3_next_layout(source, tmp_path / "next")
    assert json.loads((layout / "config.json").read_text())["model_type"] == "qwen3_next"
    assert relaid_digest(source) == weights_digest(layout) != weights_digest(source)
    a = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(str(layout), dtype=torch.float32).eval()
    assert type(a).__name__ == "Qwen3_5MoeForCausalLM" and type(b).__name__ == "Qwen3NextForCausalLM"
    ids = torch.randint(0, a.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(heads))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_a_checkpoint_without_a_qwen3_next_layout_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint("qwen3.5", tmp_path / "dense", seed=1)
    with pytest.raises(PrecisionError, match="vLLM's Qwen3-Next needs MoE layers"):
        write_qwen3_next_layout(dense, tmp_path / "out")
    assert not (tmp_path / "out").exists() and relaid_digest(dense) is None
    vision = tmp_path / "vl"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": {}}))
    with pytest.raises(PrecisionError, match="a vision-language checkpoint"):
        write_qwen3_next_layout(vision, tmp_path / "out")
    assert not (tmp_path / "out").exists()
