"""The rollout side: a real inference engine (vLLM's CPU build, in this process) on given token ids, as a dump.

    fx-precision rollout --engine vllm --model CKPT --prompt-lens 7,40,150,301 --max-tokens 8 --out DUMP
    (run where vLLM is installed: python -m fx_precision.tools.engine_env .venv-engine builds that environment)

    DUMP/manifest.json
    ├── sequences      per prompt: its token ids and the tokens vLLM sampled (prompt then generated)
    ├── records        <logprobs> seq[i]: the fp32 log-prob of every token but the first, prompt then
    │                  generated, as vLLM returned them (prompt_logprobs=0, logprobs=0)
    │                  --modules: every module's output (and input) of each prompt's prefill, renamed to
    │                  transformers FQNs and paths, one call per prompt (call i = prompt i)
    ├── engine         name, version, dtype, custom ops, attention backend and ISA, CPU kernels build,
    │                  threads, KV-cache block size, rounding on store (probed)
    └── contract       what the probes found the engine computes (see fx_precision.contract)

vLLM's modules to transformers' (Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Granite decoders):

    qkv_proj  (out, bias)        ->  q_proj, k_proj, v_proj outputs (split by head counts)
    gate_up_proj (out, bias)     ->  gate_proj, up_proj outputs
    layers.i (mlp_out, residual) ->  layers.i output: bf16(mlp_out + residual), as transformers adds
    *_layernorm (x, residual)    ->  input bf16(x + residual); output: the normalised x
    self_attn                    ->  out[0];  o_proj, down_proj (out, bias) -> out
    model                        ->  out.last_hidden_state

Nothing here is imported by the core; ``vllm`` is imported only when a rollout runs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.dump import CallInfo, Dump, Record, Sequence
from fx_precision.errors import PrecisionError

ENGINES = ("vllm",)
ISA_CHOICES = ("auto", "avx2", "avx512")  # auto: what vLLM picks on this machine; the others force a kernel build
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: hooks see the model
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries --json only
}


@dataclass(frozen=True)
class RolloutConfig:
    model: str  # checkpoint directory
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = 8
    seed: int = 0
    temperature: float = 1.0
    modules: bool = False
    threads: int = 1
    custom_ops: str = "default"  # "default": vLLM's choice (C++ rotary on CPU); "none": native torch forms
    split_kv: str = "default"  # "default": the environment's VLLM_CPU_ATTN_SPLIT_KV (vLLM: on); "on" | "off"
    isa: str = "auto"
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def synthetic_prompts(vocab: int, lengths: Seq[int], seed: int) -> tuple[tuple[int, ...], ...]:
    """Token ids from a fixed seed: one prompt per length."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in lengths)


def read_prompts(path: str) -> tuple[tuple[int, ...], ...]:
    """A JSON file holding a list of token-id lists."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PrecisionError(f"--prompts {path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, list) or not data or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data):
        raise PrecisionError(f"--prompts {path}: expected a JSON list of non-empty lists of token ids, e.g. [[1, 2, 3], [4, 5]]")
    return tuple(tuple(p) for p in data)


def check_prompts(prompts: Seq[Seq[int]], vocab: int, max_len: int, max_tokens: int, where: str) -> None:
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PrecisionError(f"prompt {i}: token id {bad[0]} is outside the vocabulary of {where} (0..{vocab - 1})")
        if len(prompt) + max_tokens > max_len:
            raise PrecisionError(
                f"prompt {i}: {len(prompt)} tokens + {max_tokens} generated exceed the {max_len} positions of {where}; "
                "shorten it or generate fewer"
            )


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------


def _force_isa(isa: str) -> None:
    """Make vLLM load another build of its CPU kernels: it picks by these checks (vllm/platforms/cpu.py)."""
    if isa == "auto":
        return
    torch.cpu._is_amx_tile_supported = lambda: False  # type: ignore[attr-defined]
    if isa == "avx2":
        torch.cpu._is_avx512_supported = lambda: False  # type: ignore[attr-defined]
        torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise PrecisionError(
            f"the vllm engine is not installed in this environment ({exc}); build the engine environment with "
            "`python -m fx_precision.tools.engine_env .venv-engine` and run fx-precision rollout from it"
        ) from None
    return vllm


def engine_max_len(config: Any) -> int:
    """The positions the engine is started with: the config's, at most 4096 (the KV cache is sized for it)."""
    return min(int(getattr(config, "max_position_embeddings", 2048) or 2048), 4096)


@dataclass
class Engine:
    """A live vLLM engine on one checkpoint, and its model object."""

    llm: Any
    model: Any
    info: dict[str, Any]
    config: Any  # the checkpoint's transformers config

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)


def start_engine(cfg: RolloutConfig) -> Engine:
    """``LLM(...)`` on ``cfg.model`` in this process (see ENGINE_ENV), with the ISA and custom ops asked for."""
    from fx_precision.tools.checkpoint import read_checkpoint_config, weights_fingerprint

    cc = read_checkpoint_config(cfg.model)  # a bad checkpoint is one line before the engine starts
    for key, value in {**ENGINE_ENV, "OMP_NUM_THREADS": str(cfg.threads)}.items():
        os.environ[key] = value
    if cfg.split_kv != "default":  # split-KV attention on several threads: an order of sums the contract does not follow
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "1" if cfg.split_kv == "on" else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engine's own warnings (with its tracebacks) on request only
    torch.set_num_threads(cfg.threads)  # torch read OMP_NUM_THREADS at import; the engine's kernels ask OpenMP
    _force_isa(cfg.isa)
    vllm = import_vllm()
    from vllm import LLM

    max_len = cfg.max_model_len or engine_max_len(cc.config)
    kwargs: dict[str, Any] = dict(
        model=str(cc.file.parent), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len, seed=cfg.seed,
        enable_prefix_caching=False,  # every prefill computed whole: the module pass records each prompt from its first token
    )  # fmt: skip
    if cfg.custom_ops == "none":
        kwargs["compilation_config"] = {"custom_ops": ["none"]}
    started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the engine refuses the checkpoint: its reason, in one line
        raise PrecisionError(f"vLLM cannot load {cfg.model}: {_last_line(exc)}") from None
    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    attn = next((m for m in model.modules() if hasattr(m, "isa") and hasattr(m, "impl")), None)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    info = {
        "name": "vllm",
        "version": vllm.__version__,
        "package": _dist_name(),
        "dtype": "bf16",
        "model_class": type(model).__name__,
        "custom_ops": cfg.custom_ops,
        "attention_backend": type(attn.impl).__name__ if attn is not None else None,
        "attention_isa": getattr(attn, "isa", None),
        "kernels": _kernel_build(),
        "isa_forced": cfg.isa,
        "cpu_flags": _cpu_flags(),
        "threads": torch.get_num_threads(),
        "block_size": block_size,
        "max_model_len": max_len,
        "checkpoint": str(cc.file.parent.resolve()),
        "weights": weights_fingerprint(cc.file.parent),
        "split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0",
        "start_seconds": round(time.perf_counter() - started, 1),
    }
    return Engine(llm, model, info, cc.config)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {(text.splitlines()[-1] if text else '')[:400]}"


def _dist_name() -> str | None:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _kernel_build() -> str:
    """Which of vLLM's CPU kernel libraries it chose (vllm/platforms/cpu.py import_kernels)."""
    if not torch.cpu._is_avx512_supported():
        return "AVX2 (_C_AVX2)"
    return "AVX512+BF16 (_C)" if torch.cpu._is_avx512_bf16_supported() else "AVX512 (_C_AVX512)"


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(set(flags) & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


class _StepRecorder:
    """Every engine forward's rows as (position, token), and the row count of every logits computation:
    the engine's kernels may depend on how many rows a step holds (its batch), so the training side
    needs to know which step computed each row."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.steps: list[list[tuple[int, int]]] = []
        self.logits: list[tuple[int, int]] = []  # (step index, rows)
        self.norm_calls = {"with_residual": 0, "without": 0}  # how the model calls its norms after an attention block
        self.handles: list[Any] = []

    def __enter__(self) -> _StepRecorder:
        def forward(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            if isinstance(ids, torch.Tensor) and isinstance(positions, torch.Tensor):
                self.steps.append(list(zip(positions.flatten().tolist(), ids.flatten().tolist(), strict=True)))

        def logits(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2), None)
            if hidden is not None:
                self.logits.append((len(self.steps) - 1, int(hidden.shape[0])))

        def norm(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            self.norm_calls["with_residual" if isinstance(residual, torch.Tensor) else "without"] += 1

        self.handles.append(self.model.register_forward_pre_hook(forward, with_kwargs=True))
        for name, module in self.model.named_modules():
            if name.endswith("post_attention_layernorm"):  # Llama-style models fuse the residual add into this norm, or not (Granite)
                self.handles.append(module.register_forward_pre_hook(norm, with_kwargs=True))
        processor = getattr(self.model, "logits_processor", None)
        if processor is not None:
            self.handles.append(processor.register_forward_pre_hook(logits, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def generate(engine: Engine, cfg: RolloutConfig) -> Dump:
    """Sample ``cfg.max_tokens`` per prompt with log-probs of every prompt and generated token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    check_prompts(cfg.prompts, engine.vocab, engine.info["max_model_len"], cfg.max_tokens, cfg.model)
    params = SamplingParams(
        max_tokens=cfg.max_tokens, prompt_logprobs=0, logprobs=0, temperature=cfg.temperature, seed=cfg.seed, detokenize=False
    )
    started = time.perf_counter()
    with _StepRecorder(engine.model) as steps:
        try:
            outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in cfg.prompts], params, use_tqdm=False)
        except Exception as exc:  # a kernel the engine has no variant for (e.g. CPU attention at head_dim 8): one line
            raise PrecisionError(f"vLLM cannot run {cfg.model}: {_last_line(exc)}") from None
    seconds = time.perf_counter() - started
    dump = Dump(_architecture(engine.config), inputs=cfg.modules, source=f"vllm {engine.info['version']} ({engine.info['kernels']})")
    dump.engine = {
        **engine.info,
        "generate_seconds": round(seconds, 3),
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "steps": steps.steps,  # each forward's rows: [position, token]
        "logits_calls": steps.logits,  # [step, rows] of each logits computation
        "norm_calls": steps.norm_calls,
    }
    for prompt, out in zip(cfg.prompts, outputs, strict=True):
        prompt_lp = [_logprob(entry, prompt[i]) for i, entry in enumerate(out.prompt_logprobs) if i > 0]
        sample = out.outputs[0]
        generated = list(sample.token_ids)
        gen_lp = [_logprob(entry, t) for entry, t in zip(sample.logprobs, generated, strict=True)]
        dump.add_logprobs(Sequence(tuple(prompt) + tuple(generated), len(prompt)), torch.tensor(prompt_lp + gen_lp, dtype=torch.float32))
    return dump


def _logprob(entry: dict[int, Any], token: int) -> float:
    if entry is None or token not in entry:
        raise PrecisionError(f"vLLM returned no log-prob for token {token}; ask for prompt_logprobs=0 and logprobs=0")
    return float(entry[token].logprob)


def _architecture(config: Any) -> str:
    names = getattr(config, "architectures", None) or []
    return str(names[0]) if names else type(config).__name__.replace("Config", "ForCausalLM")


# ---------------------------------------------------------------------------------------------
# module outputs, renamed to transformers FQNs
# ---------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.\d+$")


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _added(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """What transformers' stream holds where vLLM carries (x, residual): their bf16 sum."""
    return x if residual is None else (x.float() + residual.float()).to(x.dtype)


class _ModuleRecorder:
    """Forward hooks on vLLM's model recording each prompt's prefill as transformers would name it."""

    def __init__(self, model: Any, config: Any) -> None:
        self.model = model
        heads, kv = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.qkv = (heads * head_dim, kv * head_dim, kv * head_dim)
        self.chunks: dict[tuple[str, str, str], list[torch.Tensor]] = {}
        self.order: list[str] = []
        self.handles: list[Any] = []
        self.pending: dict[int, list[tuple[Any, dict[str, Any]]]] = {}

    def __enter__(self) -> _ModuleRecorder:
        for fqn, module in self.model.named_modules():
            if fqn:
                self.handles.append(module.register_forward_pre_hook(self._pre(), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post(fqn), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre(self) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            clone = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]  # rotary works in place
            self.pending.setdefault(id(module), []).append((clone, dict(kwargs)))

        return hook

    def _post(self, fqn: str) -> Any:
        def hook(module: Any, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any) -> None:
            args, kwargs = self.pending[id(module)].pop()
            for name, io, path, tensor in self._rename(fqn, args, kwargs, output):
                key = (name, io, path)
                if key not in self.chunks:
                    self.chunks[key] = []
                    if name not in self.order:
                        self.order.append(name)
                self.chunks[key].append(tensor.detach().cpu().clone())

        return hook

    def _rename(self, fqn: str, args: list[Any], kwargs: dict[str, Any], out: Any) -> list[tuple[str, str, str, torch.Tensor]]:
        leaf = fqn.rsplit(".", 1)[-1]
        arg = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]

        def named(index: int, name: str) -> Any:
            return args[index] if len(args) > index else kwargs.get(name)

        if fqn == "model.embed_tokens":
            return [(fqn, "out", "out", _first(out))]
        if fqn == "model":
            return [(fqn, "out", "out.last_hidden_state", _first(out))]
        if _LAYER.match(fqn):  # forward(positions, hidden_states, residual) -> (mlp_out, residual)
            hidden, residual = named(1, "hidden_states"), named(2, "residual")
            return [(fqn, "in", "args[0]", _added(hidden, residual)), (fqn, "out", "out", _added(out[0], out[1]))]
        if leaf.endswith("layernorm") or fqn == "model.norm":
            return [(fqn, "in", "args[0]", _added(named(0, "x"), named(1, "residual"))), (fqn, "out", "out", _first(out))]
        if leaf == "qkv_proj":
            parts = _first(out).split(list(self.qkv), dim=-1)
            base = fqn.rsplit(".", 1)[0]
            return [r for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True) for r in (
                (f"{base}.{name}", "in", "args[0]", arg[0]), (f"{base}.{name}", "out", "out", part))]  # fmt: skip
        if leaf == "gate_up_proj":
            gate, up = _first(out).chunk(2, dim=-1)
            base = fqn.rsplit(".", 1)[0]
            return [r for name, part in (("gate_proj", gate), ("up_proj", up)) for r in (
                (f"{base}.{name}", "in", "args[0]", arg[0]), (f"{base}.{name}", "out", "out", part))]  # fmt: skip
        if leaf in ("o_proj", "down_proj", "q_norm", "k_norm", "mlp"):
            return [(fqn, "in", "args[0]", arg[0]), (fqn, "out", "out", _first(out))]
        if leaf == "self_attn":
            return [(fqn, "in", "kwargs.hidden_states", named(1, "hidden_states")), (fqn, "out", "out[0]", _first(out))]
        return []  # rotary_emb, attn, act_fn, logits_processor: no transformers module of the same meaning

    def records(self, call: int) -> tuple[list[Record], list[CallInfo]]:
        """The recorded prefill (its chunks joined along the tokens), as call ``call`` of each module."""
        records, calls = [], []
        for key, pieces in self.chunks.items():
            name, io, path = key
            tensor = torch.cat(pieces, dim=0).unsqueeze(0)  # [tokens, ...] -> [1, tokens, ...] as a batch of one
            records.append(Record(name, call, io, path, dtype_name(tensor.dtype), tuple(tensor.shape), tensor))
        clock = 0
        for name in reversed(self.order):  # children before parents, as transformers' hooks complete
            clock += 1
            calls.append(CallInfo(name, call, -clock, clock))
        self.chunks.clear()
        self.order.clear()
        return records, calls


def record_modules(engine: Engine, cfg: RolloutConfig, dump: Dump) -> None:
    """Each sequence (prompt and its generated tokens) as one prefill alone (``max_tokens=1``), every
    module recorded and renamed (call i = sequence i): the engine's forward over what a teacher-forced
    training forward sees."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=cfg.temperature, seed=cfg.seed, detokenize=False)
    steps, logits_calls = [], []
    for call, sequence in enumerate(dump.sequences):
        prompt = sequence.tokens
        with _ModuleRecorder(engine.model, engine.config) as recorder, _StepRecorder(engine.model) as stepped:
            engine.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
        logits_calls += [(len(steps) + step, rows) for step, rows in stepped.logits]
        steps += stepped.steps
        records, calls = recorder.records(call)
        dump.records.extend(records)
        dump.calls.extend(calls)
        ids = torch.tensor([prompt])
        dump.records.append(Record("", call, "in", "kwargs.input_ids", "int64", tuple(ids.shape), ids))  # as the training side calls
        dump.calls.append(CallInfo("", call, -10_000 * (call + 1), 10_000 * (call + 1)))
    dump.engine["module_steps"] = steps  # the module pass's forwards: each sequence alone (its rows' linear orders)
    dump.engine["module_logits_calls"] = logits_calls


def run_rollout(cfg: RolloutConfig) -> Dump:
    """Start vLLM, generate with log-probs, optionally record module outputs, probe its arithmetic."""
    engine = start_engine(cfg)
    dump = generate(engine, cfg)
    if cfg.modules:
        record_modules(engine, cfg, dump)
    from fx_precision.contract.probe import probe_engine

    body = {len(rows) for key in ("steps", "module_steps") for rows in dump.engine.get(key, [])}
    logits = {int(rows) for key in ("logits_calls", "module_logits_calls") for _, rows in dump.engine.get(key, [])}
    steps = [[(int(p), int(t)) for p, t in rows] for rows in dump.engine["steps"]]
    contract = probe_engine(engine, engine.info["checkpoint"], dump.engine["norm_calls"], body, logits, dump.sequences, steps)
    dump.contract = contract.to_dict()
    dump.engine["rounding"] = dump.contract.get("rounding")
    return dump
