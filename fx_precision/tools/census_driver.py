"""The training side's steps (training_side.STEPS: build, policy, plan, eager fix, shard, hooks) -> census, on N gloo
ranks; the reference wrap users write without fx_precision; and the demo's five policies.

demo (tiny Qwen3.5, fp32 master, fp32 gather)
├── as-is              bf16 autocast, boundary re-cast on,  embedding gathered fp32   -> leaks
├── re-cast off only   bf16 autocast, boundary re-cast off, embedding gathered fp32   -> leaks
├── embedding only     bf16 autocast, boundary re-cast on,  embedding gathered bf16   -> leaks
├── both fixes         bf16 autocast, boundary re-cast off, embedding gathered bf16   -> 0 fp32
├── eager fix          bf16 autocast, boundary re-cast off, the backend's casts as hooks (no hand rule) -> 0 fp32
└── default            no autocast (everything fp32, as before any of this)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from fx_precision.census import Census, census
from fx_precision.errors import PrecisionError
from fx_precision.fsdp import layer_wrap_globs
from fx_precision.module_graph import module_label
from fx_precision.policy import PrecisionPolicy
from fx_precision.policy_flags import PolicyFlags
from fx_precision.ranks import cpu_mesh, rank_device, run_on_ranks
from fx_precision.tools.compare_sides import ZooTokens
from fx_precision.tools.zoo import build_model, forward_kwargs
from fx_precision.training_side import RunConfig, build_training_side


@dataclass(frozen=True)
class CensusConfig:
    """One census run. ``cast_forward_inputs``: True/False, or None for the policy's own resolution."""

    label: str = "census"
    meaning: str = ""
    model: str = "qwen3_5-tiny"
    gather: str = "fp32"
    compute: str | None = "bf16"
    master: str | None = "fp32"
    rules: str = ""
    arch_rules: bool = True
    cast_forward_inputs: bool | None = None
    batch: int = 2
    seq_len: int = 16
    backward: bool = False
    seed: int = 0
    mesh: tuple[int, int] | None = None  # HSDP: (replicas, shards); None: a 1-D mesh over every rank
    plain_wrap: bool = False  # reference: plain per-layer fully_shard with MixedPrecisionPolicy(fp32, fp32)
    eager_fix: bool = False  # the backend's casts as module hooks (fxp.eager_casts), derived before the wrap

    def flags(self) -> PolicyFlags:
        """The policy flags of this census (fx_precision/policy_flags.py)."""
        return PolicyFlags(self.master, self.gather, self.compute, self.rules, self.arch_rules, self.cast_forward_inputs)

    def build_dtype(self) -> Any:
        """What a checkpoint config is built at: the master dtype (None, "as loaded": what the file stores)."""
        return self.flags().build_dtype()

    def policy(self, model: Any) -> PrecisionPolicy:
        return self.flags()(model)


def plain_layer_wrap(model: Any, mesh: Any) -> None:
    """The reference: what users write without fx_precision, ``fully_shard`` per decoder layer and
    on the root, ``MixedPrecisionPolicy(fp32, fp32)``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for glob in layer_wrap_globs(model):
        parent = model.get_submodule(glob.removesuffix(".*"))
        for layer in parent.children():
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


@dataclass(frozen=True)
class RankModel:
    """A census's ModelSource (training_side): the model by name at the run's build dtype, on the rank's device."""

    name: str
    seed: int
    dtype: Any
    device: str

    def __call__(self) -> nn.Module:
        return build_model(self.name, seed=self.seed, dtype=self.dtype).to(self.device)


def census_on_rank(rank: int, world_size: int, configs: list[CensusConfig]) -> list[dict[str, Any]]:
    """Runs inside each rank: every config on a model built and wrapped afresh by the training side's steps (the reference
    wrap, ``plain_wrap``, as users write it)."""
    out = []
    device = rank_device(rank)  # the CPU, or this rank's GPU under --device cuda
    for cfg in configs:
        mesh = cpu_mesh(world_size, cfg.mesh, device.type)
        source = RankModel(cfg.model, cfg.seed, cfg.build_dtype(), str(device))
        tokens = ZooTokens(cfg.batch, cfg.seq_len, cfg.seed + 1, str(device))
        if cfg.plain_wrap:
            model = source()
            policy = cfg.policy(model)
            plain_layer_wrap(model, mesh)
            plan_units: list[str] = []
        else:  # the model in the mode it was built in, as the census always took it
            run = RunConfig(source, policy=cfg.flags(), train=None, eager_fix=cfg.eager_fix, example_ids=tokens,
                            world_size=world_size, mesh=cfg.mesh)  # fmt: skip
            side = build_training_side(run, mesh)
            model, policy = side.model, side.policy
            plan_units = [f"{module_label(u.fqn)}:{u.gather}" for u in side.plan.units]
        ids = tokens(model)
        with policy.forward_context(device.type):
            try:
                result = census(model, ids, backward=cfg.backward, **forward_kwargs(model))
            except PrecisionError:
                raise
            except Exception as exc:  # the model's own forward: one line to the caller, not a rank traceback
                raise PrecisionError(f"the forward of {type(model).__name__} raised {type(exc).__name__}: {exc}") from exc
        out.append({"config": asdict(cfg), "policy": policy.describe(), "units": plan_units, "census": result.to_dict()})
    return out


def run_census(configs: list[CensusConfig], world_size: int = 1) -> list[tuple[CensusConfig, str, Census]]:
    """Every config on ``world_size`` real gloo ranks; rank 0's censuses, with the policy text."""
    rank0 = run_on_ranks(census_on_rank, world_size, configs)[0]
    return [(cfg, r["policy"], Census.from_dict(r["census"])) for cfg, r in zip(configs, rank0, strict=True)]


def demo_configs(model: str = "qwen3_5-tiny") -> list[CensusConfig]:
    emb = "*embed_tokens=bf16"
    base = CensusConfig(model=model, arch_rules=False)
    return [
        CensusConfig(
            **{
                **asdict(base),
                "label": "as-is",
                "cast_forward_inputs": True,
                "meaning": "bf16 autocast; FSDP2 re-casts unit inputs to fp32; embedding gathered fp32",
            }
        ),
        CensusConfig(
            **{
                **asdict(base),
                "label": "re-cast off only",
                "cast_forward_inputs": False,
                "meaning": "no boundary re-cast, but F.embedding (not autocast-covered) still emits fp32",
            }
        ),
        CensusConfig(
            **{
                **asdict(base),
                "label": "embedding bf16 only",
                "rules": emb,
                "cast_forward_inputs": True,
                "meaning": "embedding emits bf16, but every unit boundary re-casts to fp32",
            }
        ),
        CensusConfig(
            **{
                **asdict(base),
                "label": "both fixes",
                "rules": emb,
                "cast_forward_inputs": False,
                "meaning": "what resolve_policy gives Qwen3.5: the stream stays bf16",
            }
        ),
        CensusConfig(
            **{
                **asdict(base),
                "label": "eager fix (derived)",
                "cast_forward_inputs": False,
                "eager_fix": True,
                "meaning": "no rule by hand: the backend's casts as module hooks (fxp.eager_casts), boundary re-cast off",
            }
        ),
        CensusConfig(
            **{
                **asdict(base),
                "label": "default (no autocast)",
                "compute": None,
                "cast_forward_inputs": None,
                "meaning": "fp32 everywhere, as before any mixed precision",
            }
        ),
    ]


def demo_rows(results: list[tuple[CensusConfig, str, Census]]) -> list[dict[str, Any]]:
    rows = []
    for cfg, policy, c in results:
        floats = c.float_totals()
        n_float = sum(floats.values())
        rows.append(
            {
                "policy": cfg.label,
                "float_tensors": n_float,
                "fp32": floats.get("fp32", 0),
                "bf16": floats.get("bf16", 0),
                "fp32_share": floats.get("fp32", 0) / n_float if n_float else 0.0,
                "int64_paths": sorted({f"{module_label(e.module)}:{e.path}" for e in c.entries if e.dtype == "int64"}),
                "totals": c.totals(),
                "meaning": cfg.meaning,
                "resolved": policy,
            }
        )
    return rows
