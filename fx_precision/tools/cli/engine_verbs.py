"""The engine wing's verbs: checkpoint (a seeded checkpoint both sides load), rollout (the engine on token ids, its dump
and contract: engines/rollout) and onpolicy (the RL loop: onpolicy/)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from fx_precision.engines import live_engines
from fx_precision.engines.adapter import DEFAULT_LAUNCH, LAUNCHES, RolloutConfig
from fx_precision.engines.vllm.cpu_family import ISA_CHOICES
from fx_precision.errors import PrecisionError
from fx_precision.tools.cli.args import (
    RANKS_WHY,
    Parser,
    Verb,
    add_json_arg,
    add_out_args,
    add_top_args,
    bounded_float,
    bounded_int,
    emit,
    max_ranks,
    prompt_lengths,
)

if TYPE_CHECKING:
    from fx_precision.onpolicy import OnPolicyConfig

    pass


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from fx_precision.tools.checkpoint import write_shaped_checkpoint, write_tiny_checkpoint

    if sum(x is not None for x in (args.model, args.config, args.as_qwen3_next)) != 1:
        raise PrecisionError("checkpoint takes --model ARCH (a tiny checkpoint), --config CONFIG --layers N (a published shape) or "
                             "--as-qwen3-next DIR (a Qwen3.5-MoE checkpoint laid out as Qwen3-Next)")  # fmt: skip
    if args.config is not None and args.layers is None:
        raise PrecisionError("--config writes a published shape with fewer layers: give --layers N")
    if args.config is None and (args.layers is not None or args.experts is not None):
        flag = "--layers" if args.layers is not None else "--experts"
        raise PrecisionError(f"{flag} goes with --config (a published shape); a tiny --model checkpoint has 3 layers")
    if args.as_qwen3_next is not None:
        from fx_precision.tools.gdn_layout import write_qwen3_next_layout

        out = write_qwen3_next_layout(args.as_qwen3_next, args.out, overwrite=args.overwrite)
        data = {"out": str(out), "from": args.as_qwen3_next, "files": sorted(p.name for p in out.iterdir())}
        emit(args, data, lambda: f"wrote {out}: {args.as_qwen3_next}'s weights laid out as Qwen3-Next ({', '.join(data['files'])})")
        return 0
    if args.config is not None:
        out = write_shaped_checkpoint(args.config, args.out, layers=args.layers, seed=args.seed, overwrite=args.overwrite,
                                      experts=args.experts)  # fmt: skip
        cut = f", {args.experts} experts per MoE layer" if args.experts is not None else ""
        what = f"{args.config}'s shape with {args.layers} layer(s){cut}"
    else:
        out = write_tiny_checkpoint(args.model, args.out, seed=args.seed, overwrite=args.overwrite)
        what = f"a tiny {args.model}"
    data = {"out": str(out), "arch": args.model, "config": args.config, "layers": args.layers, "experts": args.experts, "seed": args.seed,
            "files": sorted(p.name for p in out.iterdir())}  # fmt: skip
    emit(args, data, lambda: f"wrote {out}: {what}, seeded random weights, bf16 safetensors ({', '.join(data['files'])})")
    return 0


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    """checkpoint's flags."""
    p.add_argument("--model", metavar="ARCH", help="a tiny checkpoint of an architecture of fx-precision sweep (qwen3, llama, qwen2, ...)")
    p.add_argument("--as-qwen3-next", metavar="DIR", help="a Qwen3.5-MoE (text) checkpoint to write laid out as Qwen3-Next")
    p.add_argument("--config", metavar="CONFIG", help="a published model's config.json (or its directory): its every dimension")
    p.add_argument("--layers", type=bounded_int("--layers", 1, 1024), help="with --config: the decoder layers to keep")
    p.add_argument("--experts", type=bounded_int("--experts", 1, 4096),
                   help="with --config: experts per MoE layer to keep (each expert and the experts per token as published)")  # fmt: skip
    add_out_args(p, "checkpoint")
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=0)
    add_json_arg(p)


CHECKPOINT = Verb(
    "checkpoint",
    help="write a seeded random checkpoint of an arch-zoo architecture (bf16 safetensors + config) for both sides",
    description=(
        "A tiny checkpoint (--model ARCH: hidden 128, 3 layers, head_dim 32: sizes the engine's CPU attention runs), "
        "or a published shape (--config CONFIG --layers N: every dimension as the config states it, N layers, random weights "
        "with the architecture's initialisation), stored as published checkpoints are: bf16 safetensors and a config.json "
        "naming its dtype. --as-qwen3-next DIR: a Qwen3.5-MoE checkpoint's weights laid out as Qwen3-Next (vLLM runs Qwen3.5's "
        "GatedDeltaNet layer as Qwen3-Next's; where it cannot import Qwen3.5, roll out this layout and compare the Qwen3.5-MoE "
        "checkpoint against its dump: the dump's weights digest ties the two)."
    ),
    flags=_checkpoint_args,
    run=cmd_checkpoint,
)


def _start_as_family(isa: str) -> None:
    """Where ``--isa`` needs a variable oneDNN reads once, at its first use, and this process lacks it, run this command
    again in a process that has it from its start (cpu_family.py)."""
    from fx_precision.engines.vllm.cpu_family import family_settings
    from fx_precision.engines.vllm.session import import_vllm

    missing = {k: v for k, v in family_settings(isa).environment().items() if os.environ.get(k) != v}
    if missing:
        import_vllm()  # an environment without the engine says so here, not in a process started for it
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "fx_precision", *Parser.argv], {**os.environ, **missing})


def rollout_config(args: argparse.Namespace, prompts: tuple[tuple[int, ...], ...]) -> RolloutConfig:
    """``rollout``'s flags as the engine request the Python API takes: a flag left at its default leaves the field at
    ``RolloutConfig``'s (``--threads`` and ``--prompt-logprobs`` unset: the launch's own)."""
    return RolloutConfig(
        model=args.model, prompts=prompts, engine=args.engine, max_tokens=args.max_tokens, seed=args.seed, modules=args.modules,
        samples=args.samples, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, logprobs=args.logprobs,
        custom_ops=args.custom_ops, threads=args.threads or 0, split_kv=args.split_kv, isa=args.isa, launch=args.launch,
        prompt_logprobs=args.prompt_logprobs,
    )  # fmt: skip


def cmd_rollout(args: argparse.Namespace) -> int:
    import torch

    from fx_precision.contract import EngineContract
    from fx_precision.dump import check_out_path
    from fx_precision.engines.rollout import rollout_prompts, run_rollout

    check_out_path(args.out, overwrite=args.overwrite, sources=[args.model])  # before the engine starts
    _start_as_family(args.isa)
    prompts = rollout_prompts(args.model, args.prompts, args.prompt_lens, args.seed, args.max_tokens, args.engine, args.isa)
    dump = run_rollout(rollout_config(args, prompts))
    dump.save(args.out, overwrite=args.overwrite)
    contract = EngineContract.from_dict(dump.contract)
    engine = {k: v for k, v in (dump.engine or {}).items() if k not in ("steps", "logits_calls", "module_steps", "module_logits_calls")}
    sequences = [{"prompt_len": s.prompt_len, "tokens": len(s.tokens)} for s in dump.sequences]
    prompt_recorded = bool((dump.engine or {}).get("prompt_logprobs", True))
    values = [r.tensor if prompt_recorded else r.tensor[s.prompt_len - 1 :]
              for s, r in zip(dump.sequences, dump.logprob_records(), strict=True) if r.tensor is not None]  # fmt: skip
    non_finite = sum(int((~torch.isfinite(v)).sum()) for v in values)
    total = sum(int(v.numel()) for v in values)
    data = {"out": args.out, "engine": engine, "contract": dump.contract, "sequences": sequences, "non_finite_logprobs": non_finite}
    matched = contract.evidence.followed()
    warning = ""
    if non_finite:
        from fx_precision.checkpoints import non_finite_tensors

        bad = non_finite_tensors(args.model)
        why = f"the checkpoint holds NaN or Inf weights ({', '.join(n for n, _, _ in bad[:3])})" if bad else "the weights are finite"
        warning = f"\nNOT USABLE: {non_finite} of {total} log-probs are NaN or Inf ({why}); nothing here is a policy's log-prob"
    emit(
        args,
        data,
        lambda: (
            f"wrote {args.out}: {len(dump.sequences)} sequence(s) from {dump.source}\ncontract: {contract.describe()}\n"
            f"probes matched: {', '.join(f'{k} {v}' for k, v in matched.items())}{warning}"
        ),
    )
    return 1 if non_finite else 0


def _rollout_args(p: argparse.ArgumentParser) -> None:
    """rollout's flags."""
    p.add_argument("--engine", choices=live_engines(), default="vllm", help="the engine adapter (fx_precision/engines)")
    p.add_argument("--model", required=True, metavar="CKPT", help="a checkpoint directory (fx-precision checkpoint writes one)")
    p.add_argument("--prompts", metavar="FILE", help="a JSON list of token-id lists (default: synthetic prompts of --prompt-lens)")
    p.add_argument("--prompt-lens", type=prompt_lengths, default=[7, 40, 150, 301], help="synthetic prompt lengths (default 7,40,150,301)")
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=1, help="seed of the synthetic prompts and of sampling")
    p.add_argument("--max-tokens", type=bounded_int("--max-tokens", 1, 4096), default=8, help="tokens sampled per prompt (default 8)")
    p.add_argument("--samples", type=bounded_int("--samples", 1, 64), default=1, help="samples of each prompt, in one call (default 1)")
    p.add_argument("--temperature", type=bounded_float("--temperature", 0.0, 10.0), default=1.0, help="sampling temperature (default 1)")
    add_top_args(p)
    p.add_argument(
        "--logprobs", choices=["raw", "processed"], default="raw",
        help="the log-probs the engine returns: of the logits as they are (raw, vLLM's default) or as the sampler drew from "
        "them (processed: at the temperature, renormalised over --top-k / --top-p)",
    )  # fmt: skip
    p.add_argument(
        "--modules",
        action="store_true",
        help="also record every module's inputs and outputs (one prefill per sequence; --launch eager: hooks do not run in the "
        "compiled engine)",
    )
    p.add_argument(
        "--threads", type=bounded_int("--threads", 1, 256), default=None,
        help="the engine's OpenMP threads (default: 1 with --launch eager, the machine's cores with --launch defaults)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-logprobs", action=argparse.BooleanOptionalAction, default=None,
        help="ask the engine for the prompt tokens' log-probs too (default: yes with --launch eager, no with --launch defaults, "
        "as users sample: they add logits calls to the engine's steps)",
    )  # fmt: skip
    p.add_argument("--custom-ops", choices=["default", "none"], default="default", help="vLLM's custom ops (none: native torch forms)")
    p.add_argument(
        "--split-kv",
        choices=["default", "on", "off"],
        default="default",
        help="vLLM's split-KV CPU attention with --threads > 1 (default: the environment's VLLM_CPU_ATTN_SPLIT_KV, on in vLLM); "
        "the engine contract follows either (each row's split-KV parts and KV tiles, as the engine's scheduler placed them)",
    )
    p.add_argument(
        "--launch", choices=list(LAUNCHES), default=DEFAULT_LAUNCH,
        help="how vLLM is launched: defaults (the default, as users launch it: LLM(model, dtype=bfloat16, seed=S), compile "
        "on, prefix caching, chunked prefill, its cores; the contract follows it on a training side compiled by Inductor, "
        "compare --compiled) or eager (diagnosis: enforce_eager, no prefix caching, 1 thread, prompt log-probs). Either way "
        "the rollout sets, for its own needs: the engine in "
        "this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a KV cache of two sequences of its positions (at least 1 GiB), "
        "no thread binding, at most 8,192 positions, "
        "no tokenizer (token-id prompts); all recorded in the dump",
    )  # fmt: skip
    p.add_argument(
        "--isa", choices=ISA_CHOICES, default="auto",
        help="run the engine as this CPU family would (a test device for developers and CI: oneDNN's ISA cap, vLLM's kernel "
        "build and its AMX checks; recorded in the dump as engine.cpu_family). auto: this "
        "machine's own family. A family this CPU lacks the instructions of is refused",
    )  # fmt: skip
    add_out_args(p, "dump")
    add_json_arg(p)


ROLLOUT = Verb(
    "rollout",
    help="run a real inference engine (vLLM, in this process) on token ids and write its dump: log-probs, tokens, contract",
    description=(
        "Run where vLLM is installed (python -m fx_precision.tools.engine_env DIR builds that environment). Samples "
        "--max-tokens per prompt with the log-prob of every prompt and generated token, probes the engine's arithmetic (the "
        "contract), and with --modules records every module's inputs and outputs under transformers names."
    ),
    flags=_rollout_args,
    run=cmd_rollout,
)


def onpolicy_config(args: argparse.Namespace) -> OnPolicyConfig:
    """The OnPolicyConfig of ``fx-precision onpolicy``'s arguments (the API's defaults where a flag is left out)."""
    from fx_precision.engines.prompts import read_prompts
    from fx_precision.onpolicy import EngineLaunch, OnPolicyConfig, Sampling, Training

    sampling = Sampling(prompts=read_prompts(args.prompts) if args.prompts else None, prompt_lens=tuple(args.prompt_lens),
                        samples=args.samples, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed)  # fmt: skip
    training = Training(world_size=args.world_size, compiled=args.compiled, contract=args.contract, lr=args.lr,
                        micro_batch=args.micro_batch, replay_routes=args.replay_routes)  # fmt: skip
    engine = EngineLaunch(python=args.engine_python, threads=args.engine_threads, launch=args.engine_launch, timeout=args.engine_timeout)
    return OnPolicyConfig(checkpoint=args.model, out=args.out, steps=args.steps, mode=args.mode, modules=args.modules,
                          overwrite=args.overwrite, sampling=sampling, training=training, engine=engine)  # fmt: skip


def cmd_onpolicy(args: argparse.Namespace) -> int:
    from fx_precision.onpolicy import run_onpolicy
    from fx_precision.onpolicy.report import check_plot_path, origin_line, plot, summary_line, table

    if args.plot is not None:
        check_plot_path(args.plot)
    cfg = onpolicy_config(args)
    run = run_onpolicy(cfg)
    if run.stopped is not None and cfg.modules:
        from fx_precision.tools.train_side import name_first_origin

        name_first_origin(run, contract=cfg.training.contract == "vllm")
    if args.plot is not None:
        plot([(f"--contract {cfg.training.contract}", run)], args.plot)
    stop = (f"\nstopped: {run.stopped}" if run.stopped else "") + (f"\n{origin_line(run)}" if origin_line(run) else "")
    emit(args, run.to_dict(), lambda: f"{table(run)}\n{summary_line(run)}{stop}")
    return 1 if run.stopped else 0


def _onpolicy_args(p: argparse.ArgumentParser) -> None:
    """onpolicy's flags."""
    p.add_argument(
        "--model", required=True, metavar="CKPT", help="the starting checkpoint directory (its bf16 weights become fp32 masters)"
    )
    p.add_argument("--steps", type=bounded_int("--steps", 1, 100_000), default=10, help="RL steps (default 10)")
    p.add_argument(
        "--prompts", metavar="FILE", help="a JSON list of token-id lists, the same every step (default: fresh synthetic prompts)"
    )
    p.add_argument(
        "--prompt-lens",
        type=prompt_lengths,
        default=[8, 12, 16, 24],
        help="synthetic prompt lengths, drawn anew each step (default 8,12,16,24)",
    )
    p.add_argument("--samples", type=bounded_int("--samples", 1, 64), default=4, help="G: samples of each prompt (default 4)")
    p.add_argument("--max-tokens", type=bounded_int("--max-tokens", 1, 4096), default=8, help="tokens sampled per sample (default 8)")
    p.add_argument("--temperature", type=bounded_float("--temperature", 0.0, 10.0), default=1.0, help="sampling temperature (default 1)")
    add_top_args(p)
    p.add_argument(
        "--world-size", type=bounded_int("--world-size", 1, max_ranks, RANKS_WHY), default=2, help="FSDP2 gloo ranks (default 2)"
    )
    p.add_argument(
        "--compiled", action=argparse.BooleanOptionalAction, default=True,
        help="compile the trainer's forward with precision_backend over Inductor (default; the contract always compiles: "
        "--no-compiled runs aot_eager, which the engine at its defaults does not allow)",
    )  # fmt: skip
    p.add_argument(
        "--contract",
        choices=["vllm", "none"],
        default="vllm",
        help="follow the engine's contract (vllm) or run as users do today (none: fp32 gather, bf16 autocast)",
    )
    p.add_argument(
        "--replay-routes",
        action="store_true",
        help="an MoE model with --contract none: the trainer routes each token to the experts the engine routed it to (routing "
        "replay, R3); the router's weights and gradients stay the model's",
    )
    p.add_argument(
        "--mode", choices=["strict", "audit"], default="strict", help="strict: stop at the first mismatch; audit: report and go on"
    )
    p.add_argument(
        "--lr",
        type=bounded_float("--lr", 1e-8, 0.5),
        default=1.5e-2,
        help="AdamW learning rate (default 1.5e-2: the toy task learns in 10 steps)",
    )
    p.add_argument(
        "--micro-batch", type=bounded_int("--micro-batch", 1, 256), default=4, help="sequences per padded micro-batch (default 4)"
    )
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=0, help="seed of the prompts and of sampling")
    p.add_argument(
        "--engine-python", metavar="PYTHON", help="the engine environment's python (default: $FXP_ENGINE_PYTHON, ./.venv-engine/bin/python)"
    )
    p.add_argument(
        "--engine-threads",
        type=bounded_int("--engine-threads", 0, 256),
        default=0,
        help="the engine's OpenMP threads (default 0: the launch's own, the machine's cores at the defaults, 1 eager)",
    )
    p.add_argument(
        "--engine-launch", choices=("defaults", "eager"), default="defaults",
        help="defaults: the engine as users launch it (default: compile on, prefix caching, chunked prefill, its threads and "
        "split-KV), which the contract follows on the loop's FSDP2 trainer compiled by Inductor; the weight sync resets the "
        "prefix cache, so no step reads KV of an older policy. eager: the diagnostic engine (enforce_eager, prefix caching off, "
        "one thread, split-KV off, prompt log-probs recorded; --modules needs it)",
    )  # fmt: skip
    p.add_argument(
        "--engine-timeout", type=bounded_float("--engine-timeout", 1.0, 86400.0), default=300.0, metavar="SECONDS",
        help="the base of every engine call's time limit (default 300): probing and recording get 4x, starting 4x and at "
        "least 600 s, a generation adds 0.05 s per prompt and sampled token; an engine that does not answer in time is "
        "stopped and the run ends naming the call. A stopped or hung engine (30 s without its heartbeat) is stopped then, "
        "whatever the limit",
    )  # fmt: skip
    p.add_argument(
        "--modules", action="store_true",
        help="strict mode: the step it stops at records the engine's modules, and the comparator names the first origin "
        "(--engine-launch eager)",
    )  # fmt: skip
    p.add_argument("--plot", metavar="PNG", help="write reward and mismatch per step to this PNG (needs matplotlib)")
    add_out_args(p, "on-policy run")
    add_json_arg(p)


ONPOLICY = Verb(
    "onpolicy",
    help=(
        "an on-policy RL loop: FSDP2 trainer (fp32 masters, compiled, the engine contract) and a live vLLM, "
        "weights synced every step, the rollout's log-probs certified equal to the trainer's"
    ),
    description=(
        "Each step: the bf16 rounding of the trainer's masters synced to the engine (a memory-backed file, "
        "loaded in place, its digest checked), P prompts x G samples sampled at --temperature, the trainer's recompute and "
        "first training forward in padded micro-batches, a GRPO loss on a toy reward (the share of sampled ids divisible "
        "by 4), AdamW; the rollout, recompute and first-forward log-probs of every sampled token compared as bit "
        "patterns. --mode strict stops at the first mismatch (exit 1), audit reports and goes on. --out DIR keeps the "
        "last step's checkpoint and rollout dump (DIR/last) and metrics.json. The engine runs in its environment "
        "(--engine-python)."
    ),
    flags=_onpolicy_args,
    run=cmd_onpolicy,
)
