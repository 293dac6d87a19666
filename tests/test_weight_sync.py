"""The weights the on-policy loop sends its engine (fx_precision/onpolicy/weights.py), under the checkpoint's names.

a dense checkpoint            the trainer's masters rounded to bf16 are the stored tensors, name by name
an MoE checkpoint             transformers 5 holds the experts stacked (``experts.gate_up_proj``) and the
                              checkpoint stores each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``: the
                              sync sends the checkpoint's layout, every tensor equal to the stored one
a name the model cannot make  one line naming it
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.weights import checkpoint_bf16_weights, full_bf16_weights

pytestmark = pytest.mark.needs_transformers


def _names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return list(handle.keys())


@pytest.mark.parametrize("arch_name", ["qwen3", "qwen3-moe", "qwen2-moe"])
def test_the_sync_sends_the_checkpoints_tensors_under_its_names(arch_name: str, tmp_path: Path) -> None:
    import transformers

    from fx_precision.tools.checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(arch_name, tmp_path / "ckpt", seed=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    names = _names(path)
    if arch_name.endswith("moe"):
        assert any(".experts.0." in n for n in names) and not any(n in model.state_dict() for n in names if ".experts." in n)
    sent, stored = full_bf16_weights(model, names), checkpoint_bf16_weights(str(path), names)
    assert list(sent) == names
    assert all(sent[n].dtype == torch.bfloat16 and torch.equal(sent[n], stored[n]) for n in names)
    with pytest.raises(PrecisionError, match=re.escape("has no ['model.layers.99.mlp.experts.0.gate_proj.weight']")):
        full_bf16_weights(model, [*names, "model.layers.99.mlp.experts.0.gate_proj.weight"])
