"""Mixture-of-experts routes: which experts the engine routed each token to, on the training side too, and replay.

An MoE layer's router picks ``top_k`` of ``experts`` per token with a ``topk`` over its scores; a few ulps
of the scores apart, the engine and the trainer route a token to other experts, and the token's whole
output parts. The rollout records the engine's routes (the engine's router capture: per forward step, per
MoE layer, the expert ids of every row); the training side reads its own with a torch-function mode::

    engine dump  engine.moe = {layers, experts, top_k}         routes_of(sequences, engine)
                 engine.routes[step][layer] = ids per row  ->  per sequence [layers, T, top_k] (-1: the engine never
                                                               computed the row: the last sampled token)
    RouteTap(spec, replay=None)       entered around one training forward: every router ``topk`` over ``experts``
    ├── tap      records the experts the model routed each row to (``used``: one [rows, top_k] per MoE layer)
    └── replay   routes each row the engine routed as the engine did: the indices are the engine's and the values
                 the router's own scores gathered there (the model's weighting, renormalisation and gradients stay
                 its own); rows the engine never computed keep the model's own routes
    disagreement(engine, used)        per layer: of the rows both sides routed, the share routed to another set, and per
                                      sequence the first token routed otherwise (both sides' experts)
    moe_origin(fqn, call, out, routes)   the comparator's first origin inside an MoE block: its router (the token the
                                      routes part at, both sides' experts) or its experts (the token, routed alike)

The ``topk`` is found by what it does (over the last dimension of [tokens, experts] scores, k the experts per token;
a group top-k's scores are [tokens, groups, experts per group]), so every family transformers routes with a top-k
is covered (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3's final top-k after its group top-k); the mode works eager,
compiled (Dynamo traces it) and under FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fx_precision.errors import PrecisionError

UNROUTED = -1  # a row the engine never computed (the last sampled token is never fed)


@dataclass(frozen=True)
class MoeSpec:
    """The engine's MoE layers (their names, in layer order), expert count and experts per token."""

    layers: tuple[str, ...]
    experts: int
    top_k: int

    @classmethod
    def of(cls, engine: dict[str, Any]) -> MoeSpec | None:
        """The spec an engine dump recorded (``engine.moe``), or None for a dense model."""
        moe = engine.get("moe")
        if not moe:
            return None
        try:
            spec = cls(tuple(str(n) for n in moe["layers"]), int(moe["experts"]), int(moe["top_k"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PrecisionError(
                f"engine.moe {moe!r}: layers, experts and top_k ({exc}); write the dump again with fx-precision rollout"
            ) from None
        if not spec.layers or spec.experts < 1 or not 1 <= spec.top_k <= spec.experts:
            raise PrecisionError(f"engine.moe {moe!r}: at least one layer and 1 <= top_k <= experts")
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "experts": self.experts, "top_k": self.top_k}


def config_moe(config: Any) -> tuple[int, int] | None:
    """(experts, experts per token) of a transformers config that names an expert count, else None (dense)."""
    from fx_precision.archs.moe_experts import EXPERT_COUNT_FIELDS

    experts = next((int(getattr(config, n)) for n in EXPERT_COUNT_FIELDS if getattr(config, n, None)), 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if not experts or not top_k:
        return None
    return experts, top_k


def refuse_moe_contract(engine: dict[str, Any], flag: str, why: str | None) -> None:
    """An MoE engine dump whose contract read no MoE kernel (``why``: the probe's reason): refused before any model is
    built, with the replay that is offered instead."""
    spec = MoeSpec.of(engine)
    if spec is not None:
        raise moe_contract_refusal(flag, spec.experts, spec.top_k, why)


def moe_contract_refusal(flag: str, experts: int, top_k: int, why: str | None = None) -> PrecisionError:
    """The one line that refuses a contract on an MoE model (refuse_moe_contract), offering routing replay."""
    reason = why or "the rollout recorded no MoE kernel (written by an older fx_precision: roll out again)"
    return PrecisionError(
        f"{flag}: the model is a mixture of experts ({top_k} of {experts} experts per token) and the contract does not follow "
        f"the engine's experts here ({reason}); drop the contract and add --replay-routes to route every token to the engine's "
        "experts (the gap that is left is reported)"
    )


def routes_of(sequences: Sequence[Any], engine: dict[str, Any]) -> list[torch.Tensor]:
    """Each sequence's engine routes, [layers, T, top_k] int64 (module docstring): row r of a sequence is the row of
    the step that computed it (``batch_rows.steps_of``: prefix-cache hits read the row of the request that computed
    it), UNROUTED where no step did."""
    from fx_precision.contract.batch_rows import steps_of

    spec = MoeSpec.of(engine)
    if spec is None:
        raise PrecisionError("the engine dump records no mixture-of-experts routes (engine.moe): its model is dense")
    steps = [[(int(p), int(t)) for p, t in rows] for rows in engine.get("steps") or []]
    routes = engine.get("routes") or []
    if len(routes) != len(steps):
        raise PrecisionError(
            f"the engine dump records routes of {len(routes)} forward(s) and {len(steps)} forward step(s); write it again with "
            "fx-precision rollout of this version"
        )
    index: list[dict[tuple[int, int], int]] = []
    for i, rows in enumerate(steps):
        first: dict[tuple[int, int], int] = {}
        for j, row in enumerate(rows):
            first.setdefault(row, j)
        if len(routes[i]) != len(spec.layers) or any(len(layer) != len(rows) for layer in routes[i]):
            raise PrecisionError(f"engine.routes[{i}]: one list per MoE layer ({len(spec.layers)}) of one route per row ({len(rows)})")
        index.append(first)
    tables = [torch.tensor(step, dtype=torch.int64).reshape(len(spec.layers), -1, spec.top_k) for step in routes]
    out = []
    for s, found in zip(sequences, steps_of(sequences, steps), strict=True):
        seq = torch.full((len(spec.layers), len(s.tokens), spec.top_k), UNROUTED, dtype=torch.int64)
        for r, step in enumerate(found):
            if step is not None:
                seq[:, r] = tables[step][:, index[step][(r, int(s.tokens[r]))]]
        out.append(seq)
    return out


@dataclass
class RouteTap(TorchFunctionMode):
    """One training forward's routes (module docstring). ``replay``: [layers, rows, top_k] (the forward's rows
    flattened in order), None to tap only."""

    spec: MoeSpec
    replay: torch.Tensor | None = None
    intercept: bool = True  # False under the contract: its router op (contract/moe.py) routes, and reports here
    used: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        if self.replay is not None and not self.intercept:
            raise PrecisionError("--replay-routes and the engine contract: the contract routes as the engine does; drop --replay-routes")
        self._sunk: list[torch.Tensor] = []
        self._token: Any = None

    def __enter__(self) -> RouteTap:
        from fx_precision.contract.moe import route_sink

        self._token = route_sink(self._sunk)
        return super().__enter__() if self.intercept else self  # under the contract nothing is intercepted: no mode

    def __exit__(self, *exc: Any) -> None:
        from fx_precision.contract.moe import reset_route_sink

        if self.intercept:
            super().__exit__(*exc)
        reset_route_sink(self._token)
        self.used.extend(ids.reshape(-1, self.spec.top_k) for ids in self._sunk)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.intercept and (func is torch.topk or func is torch.Tensor.topk):
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if (isinstance(scores, torch.Tensor) and scores.dim() == 2 and dim in (-1, 1) and scores.shape[-1] == self.spec.experts
                    and k == self.spec.top_k):  # fmt: skip
                return self._route(func(*args, **kwargs), scores)
        return func(*args, **kwargs)

    def _route(self, own: Any, scores: torch.Tensor) -> Any:
        slot = len(self.used)
        if slot >= len(self.spec.layers):
            raise PrecisionError(
                f"the training forward routes more MoE layers than the engine's {len(self.spec.layers)} ({', '.join(self.spec.layers)}): "
                "not the checkpoint the engine ran"
            )
        indices = own.indices
        if self.replay is not None:
            wanted = self.replay[slot].to(indices.device).reshape(indices.shape)
            indices = torch.where(wanted >= 0, wanted, indices)
            own = torch.return_types.topk((scores.gather(-1, indices), indices))
        self.used.append(indices.detach().reshape(-1, self.spec.top_k))
        return own

    def check_complete(self) -> None:
        """Every MoE layer of the engine routed once in the forward just run."""
        if len(self.used) != len(self.spec.layers):
            raise PrecisionError(
                f"the training forward routed {len(self.used)} MoE layer(s), the engine {len(self.spec.layers)}: a router whose top-k "
                f"is not over {self.spec.experts} experts with k = {self.spec.top_k} is not found (not the checkpoint the engine ran?)"
            )


def disagreement(spec: MoeSpec, engine: Sequence[torch.Tensor], used: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Per MoE layer: of the rows both sides routed (the engine's known rows), how many went to another set of experts,
    and per sequence the first such token with both sides' experts (``first``: None where every token went alike).
    ``engine``: per sequence [layers, T, top_k]; ``used``: per sequence [layers, T, top_k] as the training side routed."""
    out = []
    for layer, name in enumerate(spec.layers):
        rows = differ = 0
        first: list[dict[str, Any] | None] = []
        for theirs, ours in zip(engine, used, strict=True):
            known = theirs[layer, :, 0] >= 0
            a = theirs[layer].sort(dim=-1).values
            b = ours[layer].sort(dim=-1).values
            parted = (a != b).any(dim=-1) & known
            rows += int(known.sum())
            differ += int(parted.sum())
            at = parted.nonzero()
            t = int(at[0, 0]) if at.numel() else None
            first.append(None if t is None else {"token": t, "engine": a[t].tolist(), "train": b[t].tolist()})
        out.append({"layer": name, "tokens": rows, "differ": differ, "share": differ / rows if rows else None, "first": first})
    return out


def moe_origin(fqn: str, call: int, output: Any, routes: dict[str, Any]) -> dict[str, Any] | None:
    """Where the comparator's first origin (``fqn``, ``call``: one sequence; ``output``: its worst output's TensorDiff)
    lies inside an MoE block (the module holding one of the engine's MoE layers), which part parted and at which token:

        the router     the origin is a module whose output is one score per expert, or the block itself with a token
                       routed to other experts at or before its first differing row: that token, both sides' experts
        the experts    the origin is the experts module, or the block itself with every token up to its first
                       differing row routed alike: that row's token
        <child>        another module of the block (a shared expert): its first differing row's token

    None where the origin lies outside every MoE block."""
    moe = routes.get("moe") or {}
    layers = {str(r["layer"]): r for r in routes.get("layers") or []}
    for experts in moe.get("layers") or []:
        block = experts.rpartition(".")[0]
        if fqn != block and not fqn.startswith(block + "."):
            continue
        row = getattr(output, "first_row", None)
        first = (layers.get(experts) or {}).get("first") or []
        parted = first[call] if 0 <= call < len(first) else None
        shape = tuple(getattr(output, "shape_a", ()) or ())
        found: dict[str, Any] = {"block": block, "layer": experts, "sequence": call}
        if fqn == experts or fqn.startswith(experts + "."):
            return {**found, "part": "experts", "token": row, "routed_alike": parted is None or (row is not None and parted["token"] > row)}
        if fqn == block and parted is not None and (row is None or parted["token"] <= row):
            return {**found, "part": "router", "token": parted["token"], "engine": parted["engine"], "train": parted["train"]}
        if fqn == block and layers.get(experts) is not None:
            return {**found, "part": "experts", "token": row, "routed_alike": True}
        if fqn == block:
            return {**found, "part": "router or experts", "token": row}
        if shape and shape[-1] == moe.get("experts"):
            return {**found, "part": "router", "token": row, "scores": True}
        return {**found, "part": fqn[len(block) + 1 :], "token": row}
    return None


def moe_origin_line(origin: dict[str, Any]) -> str:
    """compare's line naming an MoE origin (moe_origin)."""
    where = f"{origin['block']}'s {origin['part']}, sequence {origin['sequence']} token {origin['token']}"
    if origin["part"] == "router" and "engine" in origin:
        return f"MoE origin: {where}: the engine routed it to experts {origin['engine']}, the training side to {origin['train']}"
    if origin["part"] == "router":
        return f"MoE origin: {where}: the router's scores part there"
    if origin["part"] == "experts" and origin.get("routed_alike"):
        return f"MoE origin: {where}: routed to the same experts on both sides, the experts' arithmetic parts"
    if origin["part"] == "router or experts":
        return f"MoE origin: {where} (the engine's routes were not recorded: which part is not known)"
    return f"MoE origin: {where}"


def routes_summary(routes: dict[str, Any]) -> str:
    """compare's lines on an MoE run's routes (``Dump.routes``)."""
    how = {"contract": "the contract's router (the engine's top-k)", "replayed": "replayed (the engine's routes)"}.get(
        str(routes.get("routed_by")), "the training side's own"
    )
    moe = routes.get("moe") or {}
    head = f"routes: {how}; {len(moe.get('layers') or [])} MoE layer(s), {moe.get('top_k')} of {moe.get('experts')} experts per token"
    layers = routes.get("layers")
    if layers is None:
        return f"{head}; the engine's not recorded: {routes.get('why')}"
    shown = ", ".join(f"{r['layer']} {r['differ']}/{r['tokens']}" for r in layers)
    return f"{head}; tokens routed to other experts than the engine's, per layer: {shown}"
