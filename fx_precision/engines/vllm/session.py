"""A live vLLM (CPU build) in this process: start it, sample with log-probs, record its steps and modules, probe it.

    VllmSession(cfg)                 LLM(...) on the checkpoint (bf16; as users launch it, or eager with no prefix
                                     caching: cfg.launch; its own environment: ENGINE_ENV; --isa loads another kernel
                                     build, --split-kv sets VLLM_CPU_ATTN_SPLIT_KV, --threads its OpenMP threads)
    ├── generate(request)            prompts x samples in one call: sampled tokens, the log-prob of every prompt
    │                                and sampled token, each forward's rows and each logits call (StepRecorder),
    │                                an MoE model's routed experts per row and layer (RouteRecorder)
    ├── record_modules(sequences)    each sequence prefilled alone, every module renamed (modules.py)
    ├── probe(generation, modules)   every op class read off the engine's own ops (probes.py -> contract/probing.py)
    ├── load_weights(named)          the trainer's weights into the live engine, in memory
    └── describe()                   version, build, ISA, threads, block size, weights digest, ...

Nothing outside ``fx_precision/engines/vllm`` imports vLLM; here it is imported when a session starts.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fx_precision.checkpoints import read_checkpoint_config, tensors_digest, weights_digest
from fx_precision.contract import EngineContract, RotaryOp
from fx_precision.contract.attention_tiles import KvTiling
from fx_precision.contract.batch_rows import attention_calls
from fx_precision.contract.evidence import AttentionEvidence, CandidateEvidence, ContractEvidence, LinearEvidence, keeping
from fx_precision.contract.inductor_build import inductor_build
from fx_precision.contract.inductor_norms import NormReduction, engine_norm_reductions
from fx_precision.contract.linear_order import LinearOrders
from fx_precision.contract.logits import LogitsForm
from fx_precision.contract.moe import MoeKernel
from fx_precision.contract.probing import (
    check_attention_calls,
    match_attention,
    match_logprobs,
    match_norm,
    match_rotary,
    read_linear_calls,
)
from fx_precision.contract.vocabulary import NormForm, OpClass, RotaryForm
from fx_precision.dump import CallInfo, Record
from fx_precision.dump import Sequence as TokenSequence
from fx_precision.engine_description import EngineDescription
from fx_precision.engines.adapter import Generation, ModulePass, RolloutConfig, SamplingRequest
from fx_precision.engines.vllm.cpu_family import (
    FamilySettings,
    attention_merge_fused,
    cpu_flags,
    engine_kernel_build,
    family_settings,
    native_family,
)
from fx_precision.engines.vllm.gdn_probe import probe_gdn
from fx_precision.engines.vllm.modules import ModuleRecorder
from fx_precision.engines.vllm.probes import (
    engine_attention_batch,
    first_module,
    fused_norm,
    linear_calls,
    logits_processing,
    probe_moe,
    repack_experts,
)
from fx_precision.engines.vllm.sample_prompt_logprobs import ChildPromptLogprobs
from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

COMPILED_ENGINE = (
    "the engine compiled its model (vLLM's default; --launch defaults): the contract follows a compiled engine where vLLM's "
    "native fused-add norm, neox rotary and activation run inside its Inductor graph (no custom op of theirs on); roll out with "
    "--launch eager to compare against the eager engine"
)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: hooks see the model
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries --json only
}
MAX_MODEL_LEN = 8192  # positions the engine is started with at most (RL lengths: a 4,096-token prompt, 1,024 sampled)


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise PrecisionError(
            f"the vllm engine is not installed in this environment ({exc}); build the engine environment with "
            "`python -m fx_precision.tools.engine_env .venv-engine` and run fx-precision rollout from it"
        ) from None
    return vllm


NEEDS_TORCHVISION = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # vLLM's Qwen3.5 module imports Qwen3-VL's


def refuse_unimportable(config: PretrainedConfig) -> None:
    """A model whose vLLM module cannot import in this environment is refused before the engine starts, in one line:
    vLLM's Qwen3.5 module imports Qwen3-VL's vision tower, which needs torchvision (the engine environment installs
    none: the registry's wheels are CUDA builds)."""
    import importlib.util

    model_type = str(getattr(config, "model_type", ""))
    if model_type in NEEDS_TORCHVISION and importlib.util.find_spec("torchvision") is None:
        raise PrecisionError(
            f"vLLM's {model_type} model imports Qwen3-VL's vision code, which needs torchvision, and this engine environment has "
            "none (the package registry's torchvision wheels are CUDA builds): roll out a Qwen3-Next checkpoint (vLLM runs "
            "Qwen3.5's GatedDeltaNet layer as Qwen3-Next's), or install a CPU torchvision matching this torch"
        )


def _attention_block_size(attn: nn.Module | None, configured: int) -> int:
    """The tokens per block of the attention layer's own KV cache ([blocks, KV heads, block, 2 x head_dim]): a hybrid
    model's attention blocks are sized to its Mamba/GDN state pages, not the cache config's block size (vLLM at
    max_model_len 33 without prefix caching: 33 in the config, 256 in the cache); the config's where none is allocated."""
    cache = getattr(attn, "kv_cache", None)
    cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
    return int(cache.shape[2]) if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.numel() else configured


def engine_max_len(config: PretrainedConfig) -> int:
    """The positions the engine is started with: the config's, at most MAX_MODEL_LEN."""
    return min(int(getattr(config, "max_position_embeddings", 2048) or 2048), MAX_MODEL_LEN)


def _run_as(settings: FamilySettings) -> None:
    """Make this process's engine run as ``settings.family`` (cpu_family.py): oneDNN's ISA cap in the environment before
    it first runs, and the ``torch.cpu`` checks vLLM picks its kernels by."""
    os.environ.update(settings.environment())
    torch.cpu._is_amx_tile_supported = lambda: settings.amx
    torch.cpu._is_avx512_bf16_supported = lambda: settings.avx512_bf16
    torch.cpu._is_avx512_supported = lambda: settings.avx512


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip() and "For further information visit" not in line]
    return f"{type(exc).__name__}: {(lines[-1] if lines else '')[:400]}"


def _dist_name() -> str | None:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def kv_cache_gib(config: PretrainedConfig, positions: int) -> int:
    """The KV cache the engine is given (VLLM_CPU_KVCACHE_SPACE, GiB): room for one sequence of ``positions`` twice
    over (bf16 keys and values of every layer), at least 1 GiB."""
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    per_token = int(getattr(config, "num_hidden_layers", 1) or 1) * kv_heads * (_head_dim(config) or 1) * 2 * 2
    return max(1, -(-2 * per_token * positions // (1 << 30)))


def _head_dim(config: PretrainedConfig) -> int | None:
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    return int(getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)) or None


class StepRecorder:
    """Every engine forward's rows as (position, token), and the row count of every logits computation: the engine's
    GEMMs sum in an order that depends on how many rows a call holds, so the training side needs to know which call
    computed each row. Also how the model calls its post-attention norms (with a residual, or without: Granite)."""

    def __init__(self, model: nn.Module, capture_step: int | None = None) -> None:
        self.model = model
        self.steps: list[list[tuple[int, int]]] = []
        self.logits: list[tuple[int, int]] = []  # (step index, rows)
        self.capture_step = capture_step  # the logits computed at this step (the sampler's and the prompt log-probs'), kept
        self.captured: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self.norm_calls = {"with_residual": 0, "without": 0}
        self.handles: list[RemovableHandle] = []

    def __enter__(self) -> StepRecorder:
        def forward(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            if isinstance(ids, torch.Tensor) and isinstance(positions, torch.Tensor):
                self.steps.append(list(zip(positions.flatten().tolist(), ids.flatten().tolist(), strict=True)))

        def logits(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2), None)
            if hidden is not None:
                self.logits.append((len(self.steps) - 1, int(hidden.shape[0])))

        def norm(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            self.norm_calls["with_residual" if isinstance(residual, torch.Tensor) else "without"] += 1

        self.handles.append(self.model.register_forward_pre_hook(forward, with_kwargs=True))
        for name, module in self.model.named_modules():
            if name.endswith("post_attention_layernorm"):  # Llama-style models fuse the residual add into this norm, or not (Granite)
                self.handles.append(module.register_forward_pre_hook(norm, with_kwargs=True))

        def sampled(_module: nn.Module, _args: tuple[object, ...], _kwargs: dict[str, object], output: object) -> None:
            step = len(self.steps) - 1
            if step == self.capture_step and isinstance(output, torch.Tensor):
                kept = self.captured[1] if self.captured is not None else ()
                self.captured = (step, (*kept, output.detach().clone()))

        processor = getattr(self.model, "logits_processor", None)
        if processor is not None:
            self.handles.append(processor.register_forward_pre_hook(logits, with_kwargs=True))
            if self.capture_step is not None:
                self.handles.append(processor.register_forward_hook(sampled, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


class RouteRecorder:
    """The experts the engine routed every row of every forward to, per MoE layer (its routers' own capture callback,
    ``set_capture_fn``: the logical expert ids, read, nothing computed): ``routes[step][layer]`` one list of expert ids
    per row, and ``spec()`` the layers (in layer order), the expert count and the experts per token. Nothing for a
    dense model."""

    def __init__(self, model: nn.Module, steps: StepRecorder) -> None:
        self.steps = steps
        self.layers = [(name, module.router) for name, module in model.named_modules()
                       if callable(getattr(getattr(module, "router", None), "set_capture_fn", None))]  # fmt: skip
        self.routes: list[list[list[list[int]] | None]] = []
        self.mismatch: str | None = None

    def spec(self) -> dict[str, object] | None:
        if not self.layers:
            return None
        router = self.layers[0][1]
        return {"layers": [name for name, _ in self.layers], "experts": int(router.global_num_experts), "top_k": int(router.top_k)}

    def __enter__(self) -> RouteRecorder:
        def capture(ids: torch.Tensor, slot: int) -> None:
            step = len(self.steps.steps) - 1
            while len(self.routes) <= step:
                self.routes.append([None] * len(self.layers))
            rows = len(self.steps.steps[step]) if step >= 0 else -1
            if ids.shape[0] != rows and self.mismatch is None:
                self.mismatch = f"step {step}: {ids.shape[0]} routed rows for {rows} fed"
            self.routes[step][slot] = ids.to(torch.int64).tolist()

        for slot, (_name, router) in enumerate(self.layers):
            router.set_capture_fn(lambda ids, slot=slot: capture(ids, slot))
        return self

    def __exit__(self, *exc: object) -> None:
        for _name, router in self.layers:
            router.set_capture_fn(None)

    def recorded(self) -> dict[str, object]:
        """What the dump keeps (``engine.moe``, ``engine.routes``); a forward whose routing was not captured whole leaves
        the routes out and says why (``engine.routes_missing``)."""
        spec = self.spec()
        if spec is None:
            return {}
        uncaptured = (f"step {i}: a layer not captured" for i, step in enumerate(self.routes) if any(r is None for r in step))
        missing = self.mismatch or next(uncaptured, None)
        if missing is None and len(self.routes) != len(self.steps.steps):
            missing = f"{len(self.routes)} routed forwards for {len(self.steps.steps)} steps"
        if missing is not None:
            return {"moe": spec, "routes": None, "routes_missing": missing}
        return {"moe": spec, "routes": self.routes}


def _logprob(entry: dict[int, Any] | None, token: int) -> float:
    if entry is None or token not in entry:
        raise PrecisionError(f"vLLM returned no log-prob for token {token}; ask for prompt_logprobs=0 and logprobs=0")
    return float(entry[token].logprob)


def _never_fatal(op_class: OpClass, kind: type[Any], read: Any, *args: Any) -> tuple[Any, Any]:
    """``read(*args)`` -> (value, evidence), or (None, evidence of ``kind`` saying why it failed) where the probe itself
    could not run (a candidate this CPU cannot execute, an engine op that refuses the probe's shapes): the rollout,
    its dump and the as-is comparison go on, and only the contract refuses this op class, with the reason."""
    try:
        return read(*args)
    except (PrecisionError, RuntimeError, ValueError) as exc:
        return None, kind(why=f"the {op_class} probe could not run here: {_last_line(exc)}", failed=True)


class VllmSession:
    """A live vLLM on one checkpoint (module docstring)."""

    def __init__(self, cfg: RolloutConfig) -> None:
        cc = read_checkpoint_config(cfg.model)  # a bad checkpoint is one line before the engine starts
        refuse_unimportable(cc.config)
        if cfg.custom_ops not in ("default", "none"):
            raise PrecisionError(f"--custom-ops {cfg.custom_ops!r}: default or none")
        if cfg.split_kv not in ("default", "on", "off"):
            raise PrecisionError(f"--split-kv {cfg.split_kv!r}: default, on or off")
        if cfg.logprobs not in ("raw", "processed"):
            raise PrecisionError(f"log-probs {cfg.logprobs!r}: raw or processed")
        max_len = cfg.max_model_len or engine_max_len(cc.config)
        kv_cache = str(kv_cache_gib(cc.config, max_len))
        for key, value in {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": kv_cache, "OMP_NUM_THREADS": str(cfg.threads)}.items():
            os.environ[key] = value
        if cfg.split_kv != "default":  # split-KV attention on several threads: the rollout checks whether the run's calls split
            os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "1" if cfg.split_kv == "on" else "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engine's own warnings (with its tracebacks) on request only
        torch.set_num_threads(cfg.threads)  # torch read OMP_NUM_THREADS at import; the engine's kernels ask OpenMP
        family = family_settings(cfg.isa)
        _run_as(family)
        vllm = import_vllm()
        from vllm import LLM

        self.cfg = cfg
        self.config = cc.config
        self.max_len = max_len
        kwargs: dict[str, Any] = dict(
            model=str(cc.file.parent), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=self.max_len, seed=cfg.seed,
            logprobs_mode="processed_logprobs" if cfg.logprobs == "processed" else "raw_logprobs",
        )  # fmt: skip
        if cfg.launch == "eager":  # the diagnostic engine: no compile, every prefill computed whole (no prefix cache)
            kwargs.update(enforce_eager=True, enable_prefix_caching=False)
        if cfg.custom_ops == "none":
            kwargs["compilation_config"] = {"custom_ops": ["none"]}
        started = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:  # the engine refuses the checkpoint: its reason, in one line
            raise PrecisionError(f"vLLM cannot load {cfg.model}: {_last_line(exc)}") from None
        self.model = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
        self.compiled = int(self.llm.llm_engine.vllm_config.compilation_config.mode) != 0  # CompilationMode.NONE: eager
        attn = next((m for m in self.model.modules() if hasattr(m, "isa") and hasattr(m, "impl")), None)
        self.description = EngineDescription(
            name="vllm",
            version=vllm.__version__,
            package=_dist_name(),
            dtype="bf16",
            model_class=type(self.model).__name__,
            custom_ops=cfg.custom_ops,
            launch=cfg.launch,
            compilation_mode=str(self.llm.llm_engine.vllm_config.compilation_config.mode),
            compiled=self.compiled,
            inductor=inductor_build() if self.compiled else None,
            **self._norm_reductions(),
            prefix_caching=bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching),
            attention_backend=type(attn.impl).__name__ if attn is not None else None,
            attention_isa=getattr(attn, "isa", None),
            kernels=engine_kernel_build(),
            cpu_family=str(family.family),  # what the engine ran as (--isa; auto: this machine's own)
            native_family=str(native_family()),
            onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA"),
            aten_capability=torch.backends.cpu.get_cpu_capability(),
            cpu_flags=tuple(sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})),
            threads=torch.get_num_threads(),
            block_size=_attention_block_size(attn, int(self.llm.llm_engine.vllm_config.cache_config.block_size)),
            l2_cache_bytes=int(torch.cpu.get_capabilities().get("l2_cache_size") or 0) or None,  # the attention tiles from it
            head_dim=_head_dim(self.config),
            attention_window=int(getattr(attn.impl, "sliding_window", -1) or -1) if attn is not None else -1,  # -1: none
            max_model_len=self.max_len,
            kv_cache_gib=int(kv_cache),
            checkpoint=str(cc.file.parent.resolve()),
            weights=weights_digest(cc.file.parent),
            split_kv=os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0",
            logprobs=cfg.logprobs,
            start_seconds=round(time.perf_counter() - started, 1),
        )
        self._gdn = probe_gdn(self.model, self.description.kernels or "", torch.Generator().manual_seed(20261205))
        if self._gdn[2]:
            # its layers and how they ran: the dump's split of each sequence reads it
            self.description = replace(self.description, gdn=self._gdn[2])
        self.norm_calls = {"with_residual": 0, "without": 0}
        # what the probes read stays read while this engine lives (forms and orders do not depend on the weights'
        # values): a later run probes only the calls it is the first to make
        self._probed: dict[OpClass, tuple[Any, Any]] = {}  # op class -> (what it kept, its evidence)
        self._attention_seen: dict[tuple[tuple[int, int], ...], str | None] = {}
        self._linears_seen: dict[tuple[int, int, int], tuple[str, Any, dict[str, Any]]] = {}
        from safetensors import safe_open

        self.weight_names: list[str] = []
        for file in sorted(cc.file.parent.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                self.weight_names += list(handle.keys())

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    def generate(self, request: SamplingRequest) -> Generation:
        """``request.samples`` samples of each prompt in one engine call, with the log-prob of every token."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=request.samples, max_tokens=request.max_tokens, prompt_logprobs=0 if request.prompt_logprobs else None, logprobs=0,
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            detokenize=False,  # no per-request seed: the engine's generator, seeded at start
        )  # fmt: skip
        started = time.perf_counter()
        own = ChildPromptLogprobs(request.prompt_logprobs)  # each sample's own (out.prompt_logprobs: the last child's, for all)
        with StepRecorder(self.model, capture_step=0) as steps, RouteRecorder(self.model, steps) as routes, own:
            try:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in request.prompts], params, use_tqdm=False)
            except Exception as exc:  # a kernel the engine has no variant for (e.g. CPU attention at head_dim 8): one line
                raise PrecisionError(f"vLLM cannot run {self.cfg.model}: {_last_line(exc)}") from None
        seconds = time.perf_counter() - started
        for key, count in steps.norm_calls.items():
            self.norm_calls[key] += count
        sequences, logprobs = [], []
        for prompt, out in zip(request.prompts, outputs, strict=True):
            for sample in out.outputs:
                if request.prompt_logprobs:
                    prompt_lp = [_logprob(entry, prompt[i]) for i, entry in enumerate(own.of(out, sample)) if i > 0]
                else:  # not asked (users sample without): placeholders the dump marks as not recorded (engine.prompt_logprobs)
                    prompt_lp = [math.nan] * (len(prompt) - 1)
                generated = list(sample.token_ids)
                gen_lp = [_logprob(entry, t) for entry, t in zip(sample.logprobs, generated, strict=True)]
                sequences.append(TokenSequence(tuple(prompt) + tuple(generated), len(prompt)))
                logprobs.append(torch.tensor(prompt_lp + gen_lp, dtype=torch.float32))
        extra = {"norm_calls": dict(steps.norm_calls), "prompt_logprobs": request.prompt_logprobs, **routes.recorded()}
        return Generation(sequences, logprobs, steps.steps, steps.logits, seconds, extra, steps.captured, request.temperature,
                          request.top_k, request.top_p)  # fmt: skip

    def record_modules(self, sequences: Sequence[TokenSequence], temperature: float) -> ModulePass:
        """Each sequence (prompt and sampled tokens) as one prefill alone (``max_tokens=1``), every module recorded and
        renamed (call i = sequence i): the engine's forward over what a teacher-forced training forward sees."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=temperature, detokenize=False)
        records: list[Record] = []
        calls: list[CallInfo] = []
        steps: list[list[tuple[int, int]]] = []
        logits_calls: list[tuple[int, int]] = []
        for call, sequence in enumerate(sequences):
            with ModuleRecorder(self.model, self.config) as recorder, StepRecorder(self.model) as stepped:
                self.llm.generate([TokensPrompt(prompt_token_ids=list(sequence.tokens))], params, use_tqdm=False)
            logits_calls += [(len(steps) + step, rows) for step, rows in stepped.logits]
            steps += stepped.steps
            made, made_calls = recorder.records(call)
            records.extend(made)
            calls.extend(made_calls)
            ids = torch.tensor([sequence.tokens])
            records.append(Record("", call, "in", "kwargs.input_ids", "int64", tuple(ids.shape), ids))  # as the training side calls
            calls.append(CallInfo("", call, -10_000 * (call + 1), 10_000 * (call + 1)))
        return ModulePass(records, calls, steps, logits_calls)

    def probe(self, generation: Generation, module_pass: ModulePass | None = None) -> EngineContract:
        """Every op class read off the engine's own ops, at the checkpoint's shapes and at the rows, lengths and
        thread count the run used (module docstring of contract/probing.py); what matches nothing is ``unmatched``.
        Rotary, norm and the attention arithmetic are read once per engine; the run's attention calls and linear calls
        are checked where no earlier run of this engine made them; the log-probs are read off every run."""
        gen = torch.Generator().manual_seed(20261201)
        for op_class, kind, read in ((OpClass.ROTARY, CandidateEvidence, self._rotary), (OpClass.NORM, CandidateEvidence, self._norm),
                                     (OpClass.ATTENTION, AttentionEvidence, self._attention_arith)):  # fmt: skip
            if op_class not in self._probed:
                self._probed[op_class] = _never_fatal(op_class, kind, read, gen)
        if self.compiled:  # the modules' eager forms are not what the compiled graph computes: Inductor's forms
            self._probed.update(self._compiled_forms())
        rotary, rotary_found = self._probed[OpClass.ROTARY]
        norm, norm_found = self._probed[OpClass.NORM]
        attention, attention_found = _never_fatal(OpClass.ATTENTION, AttentionEvidence, self._attention_at_run, generation, gen)
        body = {len(rows) for rows in generation.steps} | ({len(rows) for rows in module_pass.steps} if module_pass else set())
        logits = {rows for _, rows in generation.logits_calls} | ({rows for _, rows in module_pass.logits_calls} if module_pass else set())
        calls = linear_calls(self.model, str(self.description.checkpoint))
        linears, linear_found = _never_fatal(OpClass.LINEARS, LinearEvidence, read_linear_calls, calls, body, logits,
                                             self.description.threads, gen, self._linears_seen)  # fmt: skip
        logprobs, logprob_found = match_logprobs(generation)
        evidence = ContractEvidence(
            attention_isa=self.description.attention_isa, kernels=self.description.kernels, cpu_family=self.description.cpu_family,
            rotary=rotary_found, norm=norm_found, eager_math=self._probed.get(OpClass.EAGER_MATH, (None, None))[1],
            attention=attention_found, linears=linear_found, logprobs=replace(logprob_found, mode=f"{self.cfg.logprobs}_logprobs"),
        )  # fmt: skip
        found_by_class: tuple[tuple[OpClass, Any, Any], ...] = (
            (OpClass.ROTARY, rotary, rotary_found), (OpClass.NORM, norm, norm_found),
            (OpClass.EAGER_MATH, self._probed.get(OpClass.EAGER_MATH, (True,))[0], evidence.eager_math),
            (OpClass.ATTENTION, attention, attention_found),
            (OpClass.LINEARS, linear_found.followed(), linear_found), (OpClass.LOGPROBS, logprobs, logprob_found),
        )  # fmt: skip
        unmatched = tuple((op_class, str(found.why or "no candidate matched")) for op_class, value, found in found_by_class
                          if value is None or value is False)  # fmt: skip
        if OpClass.MOE not in self._probed:
            self._probed[OpClass.MOE] = _never_fatal(OpClass.MOE, CandidateEvidence, self._moe, gen)
        moe, moe_found = self._probed[OpClass.MOE]
        if moe is None and moe_found is not None:  # an MoE model whose experts the contract does not follow: said why
            unmatched += ((OpClass.MOE, str(moe_found.why or "no candidate matched")),)
        gdn, gdn_found, _ = self._gdn
        if gdn is None and gdn_found is not None:  # a GatedDeltaNet model whose kernels the contract does not follow: said why
            unmatched += ((OpClass.GDN, str(gdn_found.why or "no candidate matched")),)
        evidence = replace(evidence, gdn=gdn_found)
        linears = linears if linears is not None else LinearOrders(self.description.threads)
        reductions = self.description.inductor_norms
        return EngineContract("vllm", self.description.version, norm, rotary, attention, linears, logprobs,
                              self.description.aten_capability, unmatched, evidence, self.kv_tiling(), moe,
                              self.description.inductor if self.compiled else None,
                              tuple(NormReduction.from_dict(r) for r in reductions) if self.compiled and reductions else None,
                              gdn, LogitsForm(*logits_processing(self.model)))  # fmt: skip

    def _norm_reductions(self) -> dict[str, Any]:
        """The compiled engine's norm reductions, read off the output code Inductor wrote for it (its compile cache:
        contract/inductor_norms.py), or why they were not; nothing for the eager engine."""
        if not self.compiled:
            return {}
        cache = getattr(self.llm.llm_engine.vllm_config.compilation_config, "local_cache_dir", None)
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()  # the engine's process: the ISA its Inductor compiled for
        reductions, where = engine_norm_reductions(cache, isa.nelements(torch.float32) if isa else None)
        if reductions is None:
            return {"inductor_norms": None, "inductor_norms_why": where}
        return {"inductor_norms": tuple(r.to_dict() for r in reductions), "inductor_code": where}

    def _moe(self, gen: torch.Generator) -> tuple[MoeKernel | None, CandidateEvidence | None]:
        """The engine's MoE layers read (contract/moe.py): (None, None) for a dense model; else its router and fused
        experts compared, bit for bit, with the contract's on random inputs at the model's sizes (ties among the logits
        included), or (None, why) where they are of a form the contract does not follow."""
        runners = [m for _, m in self.model.named_modules() if callable(getattr(getattr(m, "router", None), "set_capture_fn", None))]
        if not runners:
            return None, None
        return probe_moe(runners[0], self.config, gen)

    def _compiled_forms(self) -> dict[OpClass, tuple[Any, CandidateEvidence]]:
        """What the compiled engine computes between its extern calls (GEMMs, attention, experts): vLLM's native forms
        through Inductor, when no custom op of the norm, the rotary or the activation is on (read off the engine's
        compilation config); each refused with the reason otherwise."""
        cc = self.llm.llm_engine.vllm_config.compilation_config
        enabled = sorted(str(op) for op in cc.enabled_custom_ops)
        details = {"compiler": str(cc.backend or "inductor"), "mode": str(cc.mode), "custom_ops_on": ", ".join(enabled) or "none",
                   "inductor": str(self.description.inductor)}  # fmt: skip
        kernels = [op for op in enabled if op.split(".")[-1] in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")]
        if kernels or str(cc.backend or "inductor") != "inductor":
            why = f"{COMPILED_ENGINE} (custom ops on: {', '.join(kernels) or 'none'}; backend {cc.backend!r})"
            return {c: (None, CandidateEvidence(why=why, details=details)) for c in (OpClass.ROTARY, OpClass.NORM, OpClass.EAGER_MATH)}
        rope = first_module(self.model, "RotaryEmbedding")
        if rope is None:
            rotary = RotaryOp(RotaryForm.NONE, None)
            rotary_found = keeping(CandidateEvidence(details=details), rotary)
        elif not hasattr(rope, "cos_sin_cache") or not rope.is_neox_style:
            rotary, rotary_found = None, CandidateEvidence(why=f"{COMPILED_ENGINE}: {type(rope).__name__} is not vLLM's neox rotary")
        else:  # vLLM's rotary module, its native form compiled: the tables computed eagerly at load, the rotation in the graph
            rotary = RotaryOp(RotaryForm.INDUCTOR, None)
            rotary_found = keeping(CandidateEvidence(details=details), rotary)
        probed, probed_found = self._probed[OpClass.NORM]  # (a form of this engine read at an earlier probe: the loop's steps)
        if probed is None:
            return {OpClass.NORM: (None, probed_found), OpClass.ROTARY: (rotary, rotary_found)}
        form = NormForm.INDUCTOR if probed in (NormForm.FUSED_ADD, NormForm.INDUCTOR) else NormForm.INDUCTOR_STREAM
        if form is NormForm.INDUCTOR_STREAM and self.description.inductor_norms is None:
            # the model adds its residual itself (Granite's residual + h * residual_multiplier, in bf16): Inductor keeps that
            # stream in fp32 and rounds it only where a norm's kernel stores it, which only the generated code tells
            why = ("the compiled engine (--launch defaults): the model adds its residual itself, not through vLLM's fused add and "
                   "norm (Granite's residual + h * residual_multiplier), and where Inductor rounds that stream is read off the "
                   f"engine's generated code, which was not read ({self.description.inductor_norms_why}); roll out with "
                   "--launch eager, which the contract follows")  # fmt: skip
            return {OpClass.NORM: (None, CandidateEvidence(why=why, details=details)), OpClass.ROTARY: (rotary, rotary_found)}
        return {
            OpClass.NORM: (form, keeping(CandidateEvidence(details=details), form)),
            OpClass.ROTARY: (rotary, rotary_found),
            OpClass.EAGER_MATH: (True, CandidateEvidence(kept="the rotary tables only", details=details)),
        }

    def _rotary(self, gen: torch.Generator) -> tuple[RotaryOp | None, CandidateEvidence]:
        rope = first_module(self.model, "RotaryEmbedding")
        if rope is None:
            none = RotaryOp(RotaryForm.NONE, None)
            return none, keeping(CandidateEvidence(details={"module": "the model has no rotary module"}), none)
        if not hasattr(rope, "cos_sin_cache"):  # transformers' module (the engine's Transformers backend): the training side's code
            module = f"{type(rope).__module__}.{type(rope).__name__}"
            native = RotaryOp(RotaryForm.NATIVE, None)
            return native, keeping(CandidateEvidence(details={"module": module}), native)
        if not rope.is_neox_style:  # GPT-J style pairs: the contract's rotary takes neox halves
            return None, CandidateEvidence(why="interleaved (GPT-J style) rotary pairs: not followed")
        head, rot = int(rope.head_size), int(rope.rotary_dim)
        return match_rotary(lambda p, q, k: rope(p, q, k), rope.cos_sin_cache, head, rot, int(rope.max_position_embeddings), gen)

    def _norm(self, gen: torch.Generator) -> tuple[NormForm | None, CandidateEvidence]:
        norm, how = fused_norm(self.model)
        if self.norm_calls["without"] and not self.norm_calls["with_residual"]:  # the model adds its residual itself (Granite)
            return NormForm.PLAIN, keeping(CandidateEvidence(details={"called": str(dict(self.norm_calls))}), NormForm.PLAIN)
        if how == "none":
            return NormForm.PLAIN, keeping(CandidateEvidence(details={"module": "no norm after an attention block"}), NormForm.PLAIN)
        if how in ("model", "no residual"):
            return NormForm.PLAIN, keeping(CandidateEvidence(details={"module": f"{type(norm).__name__}: {how}"}), NormForm.PLAIN)
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        return match_norm(lambda x, r: norm(x, r)[0], norm.weight.detach(), eps, gen)

    def _attention_run(self) -> tuple[Any, int, int, int]:
        heads = int(self.config.num_attention_heads)
        kv_heads = int(getattr(self.config, "num_key_value_heads", heads))
        dim = int(getattr(self.config, "head_dim", None) or self.config.hidden_size // heads)
        isa, block, split = str(self.description.attention_isa), int(self.description.block_size or 0), self.description.split_kv
        scale = dim**-0.5

        def run(requests: list[Any]) -> list[torch.Tensor]:
            return engine_attention_batch(isa, block, requests, scale, split)

        return run, heads, kv_heads, dim

    def kv_tiling(self, window: int | None = None) -> KvTiling | None:
        """Where this engine's attention places its KV tiles (its ISA, L2, threads, split-KV; the model's heads), with
        the model's sliding window (``window`` None) or another (the probes' calls: -1)."""
        _, heads, kv_heads, _ = self._attention_run()
        own = self.description.attention_window
        return KvTiling.of_engine(self.description, heads, kv_heads, own if window is None else window)

    def _attention_arith(self, gen: torch.Generator) -> tuple[Any, AttentionEvidence]:
        run, heads, kv_heads, dim = self._attention_run()
        merge_fma = attention_merge_fused(self.description.kernels)
        return match_attention(run, heads, kv_heads, dim, gen, self.kv_tiling(window=-1), merge_fma)

    def _attention_at_run(self, generation: Generation, gen: torch.Generator) -> tuple[Any, AttentionEvidence]:
        arith, found = self._probed[OpClass.ATTENTION]
        if arith is not None:
            run, heads, kv_heads, dim = self._attention_run()
            shapes = attention_calls(generation.sequences, generation.steps)
            found = replace(found, at_run=check_attention_calls(run, arith, shapes, heads, kv_heads, dim, gen, self._attention_seen,
                                                                      self.kv_tiling(window=-1)))  # fmt: skip
        return arith, found

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """The engine's weights replaced in memory by ``weights`` (transformers names, bf16): vLLM's in-place reload
        restores each layer's checkpoint shapes, loads (fusing q/k/v and gate/up), and packs its kernels again; the
        embedding-type layers are packed again after it (a tied output projection shares the embedding, gets no
        tensor of its own, and would keep its old packed copy), and so are MoE experts (the reload leaves them in
        the checkpoint's layout, which the CPU fused-experts kernel would read as packed: probes.repack_experts).
        Every name must be given: a fused layer missing a part
        would be packed from uninitialised memory."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        named = dict(weights)
        expected = set(self.weight_names)
        if set(named) != expected:
            missing, extra = sorted(expected - set(named))[:3], sorted(set(named) - expected)[:3]
            raise PrecisionError(f"vllm weight sync: give every tensor of the checkpoint (missing {missing}, unknown {extra})")
        worker = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        with torch.no_grad():
            worker.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
            for module in self.model.modules():
                method = getattr(module, "quant_method", None)
                if isinstance(method, UnquantizedEmbeddingMethod) and module.weight.numel() > 0:
                    method.process_weights_after_loading(module)
            repack_experts(self.model)
        self.llm.reset_prefix_cache()
        digest = tensors_digest(named.items())  # what it runs now: the dump's weights identity
        self.description = replace(self.description, weights=digest, weights_source="synced in memory")
        return digest

    def describe(self) -> EngineDescription:
        return replace(self.description, norm_calls=dict(self.norm_calls))

    def close(self) -> None:
        self.llm = None
