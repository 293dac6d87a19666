"""MoE routes (fx_precision/routes.py): the engine's routes per sequence row, the training side's tapped, and replay.

routes_of       each row of a sequence takes the route of the engine step row that computed it (prefix-cache
                hits: the request that computed it); the last sampled token: UNROUTED
RouteTap        on real transformers MoE families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral,
                DeepSeek-V3 after its group top-k), eager and compiled (DeepSeek-V3 eager only: Dynamo refuses its
                MLA attention's sdpa call at trace time, upstream, whatever the routes): the experts receive exactly the routes
                the tap records; replayed, the engine's (UNROUTED rows keep the model's own), and the router
                still gets its gradient
disagreement    per layer, the rows routed to another set of experts (order within a row does not count)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fx_precision.archs.moe_experts import stacked_expert_fqns
from fx_precision.errors import PrecisionError
from fx_precision.routes import UNROUTED, MoeSpec, RouteTap, disagreement, refuse_moe_contract, routes_of

FAMILIES = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3")


def _model(arch_name: str) -> Any:
    from fx_precision.tools.arch_zoo import arch

    return arch(arch_name).build(seed=5).eval()


def _spec(model: torch.nn.Module, layers: int) -> MoeSpec:
    config: Any = model.config
    experts = next(int(getattr(config, n)) for n in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(config, n, None))
    return MoeSpec(tuple(f"layer{i}" for i in range(layers)), experts, int(config.num_experts_per_tok))


def _received(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[Any]]:
    """What every experts module is called with (its top-k indices), in call order."""
    seen: list[torch.Tensor] = []

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        seen.append(index.detach().reshape(-1, index.shape[-1]).clone())

    handles = [model.get_submodule(fqn).register_forward_pre_hook(hook, with_kwargs=True) for fqn in stacked_expert_fqns(model)]
    return seen, handles


@pytest.mark.needs_transformers
@pytest.mark.parametrize(("arch_name", "compiled"), [(a, False) for a in FAMILIES] + [(a, True) for a in FAMILIES if a != "deepseek-v3"],
                         ids=lambda v: {False: "eager", True: "compiled"}.get(v, v) if isinstance(v, bool) else v)  # fmt: skip
def test_the_experts_receive_what_the_tap_records_and_replay_routes_them_as_the_engine_did(arch_name: str, compiled: bool) -> None:
    model = _model(arch_name)
    layers = len(stacked_expert_fqns(model))
    assert layers >= 1
    spec = _spec(model, layers)
    ids = torch.randint(0, int(model.config.vocab_size), (1, 9), generator=torch.Generator().manual_seed(3))
    run = torch.compile(model, backend="aot_eager") if compiled else model
    seen, handles = _received(model)
    try:
        tap = RouteTap(spec)
        with tap:
            run(ids, use_cache=False)
        tap.check_complete()
        own = list(tap.used)
        assert [s.tolist() for s in seen] == [u.tolist() for u in own]  # the tap records what the experts were given
        replay = torch.stack([(torch.arange(spec.top_k) + row + layer) % spec.experts for layer in range(layers) for row in range(9)])
        replay = replay.reshape(layers, 9, spec.top_k)
        replay[:, -1] = UNROUTED  # the last token: never computed by the engine, keeps the model's own route
        seen.clear()
        tap = RouteTap(spec, replay=replay)
        with tap:
            run(ids, use_cache=False)
        tap.check_complete()
        for layer in range(layers):
            assert seen[layer][:-1].tolist() == replay[layer, :-1].tolist()
            assert seen[layer][-1].tolist() == own[layer][-1].tolist()
            assert tap.used[layer].tolist() == seen[layer].tolist()
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.needs_transformers
def test_replayed_routes_keep_the_routers_gradient() -> None:
    model = _model("qwen3-moe").train()
    spec = _spec(model, len(stacked_expert_fqns(model)))
    replay = torch.zeros(len(spec.layers), 6, spec.top_k, dtype=torch.int64)
    replay[..., 1] = 1
    with RouteTap(spec, replay=replay):
        loss = model(torch.arange(6).unsqueeze(0), use_cache=False).logits.float().square().mean()
    loss.backward()
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


@pytest.mark.needs_transformers
def test_a_forward_routing_fewer_layers_than_the_engine_is_refused() -> None:
    model = _model("mixtral")
    spec = _spec(model, len(stacked_expert_fqns(model)) + 1)
    tap = RouteTap(spec)
    with tap:
        model(torch.arange(5).unsqueeze(0), use_cache=False)
    with pytest.raises(PrecisionError, match="routed 2 MoE layer"):
        tap.check_complete()


def _seq(tokens: list[int], prompt: int) -> SimpleNamespace:
    return SimpleNamespace(tokens=tuple(tokens), prompt_len=prompt)


def test_each_row_takes_the_route_of_the_step_row_that_computed_it() -> None:
    # two samples of the prompt (7, 8, 9); the second's prompt rows are prefix-cache hits of the first's
    sequences = [_seq([7, 8, 9, 4, 5], 3), _seq([7, 8, 9, 6, 2], 3)]
    steps = [[(0, 7), (1, 8), (2, 9)], [(3, 4), (2, 9)], [(4, 5), (3, 6)]]
    # one MoE layer, top 2: the route of a row names its step and row
    routes = [[[[10 * i + j, 10 * i + j + 1] for j in range(len(rows))]] for i, rows in enumerate(steps)]
    engine = {"moe": {"layers": ["model.layers.0.mlp.experts"], "experts": 64, "top_k": 2}, "steps": steps, "routes": routes}
    first, second = routes_of(sequences, engine)
    assert first[0].tolist() == [[0, 1], [1, 2], [2, 3], [10, 11], [20, 21]]
    assert second[0].tolist() == [[0, 1], [1, 2], [11, 12], [21, 22], [UNROUTED, UNROUTED]]


def test_routes_of_refuses_a_dump_whose_routes_do_not_fit_its_steps() -> None:
    engine = {"moe": {"layers": ["a"], "experts": 4, "top_k": 2}, "steps": [[(0, 1)]], "routes": []}
    with pytest.raises(PrecisionError, match="routes of 0 forward"):
        routes_of([_seq([1, 2], 1)], engine)
    with pytest.raises(PrecisionError, match="1 <= top_k <= experts"):
        MoeSpec.of({"moe": {"layers": ["a"], "experts": 2, "top_k": 3}})
    with pytest.raises(PrecisionError, match="records no mixture-of-experts"):
        routes_of([_seq([1, 2], 1)], {"steps": [[(0, 1)]]})


def test_disagreement_counts_rows_routed_to_another_set() -> None:
    spec = MoeSpec(("l0", "l1"), 8, 2)
    engine = [torch.tensor([[[1, 2], [3, 4], [UNROUTED, UNROUTED]], [[0, 1], [2, 3], [UNROUTED, UNROUTED]]])]
    used = [torch.tensor([[[2, 1], [3, 5], [7, 6]], [[0, 1], [2, 3], [4, 5]]])]
    rows = disagreement(spec, engine, used)
    assert [(r["layer"], r["tokens"], r["differ"]) for r in rows] == [("l0", 2, 1), ("l1", 2, 0)]
    assert rows[0]["share"] == 0.5
    assert rows[0]["first"] == [{"token": 1, "engine": [3, 4], "train": [3, 5]}]  # row 2: the engine never routed it
    assert rows[1]["first"] == [None]


def _output(fqn: str, a: torch.Tensor, b: torch.Tensor) -> Any:
    """A call's output on both sides, as the comparator judges it."""
    from fx_precision.compare import tensor_diff
    from fx_precision.dump import Record

    return tensor_diff(*(Record(fqn, 1, "out", "out", "bf16", tuple(t.shape), t) for t in (a, b)))


def test_an_origin_inside_an_moe_block_names_the_router_or_the_experts_and_the_token() -> None:
    from fx_precision.routes import moe_origin, moe_origin_line

    hidden = torch.zeros(1, 6, 4)
    parted = hidden.clone()
    parted[0, 4, 2] = 1.0  # the block's output first differs at token 4
    first = [None, {"token": 2, "engine": [1, 3], "train": [1, 5]}]  # sequence 1: token 2 routed otherwise
    layers = [{"layer": "m.layers.0.mlp.experts", "first": [None, None]}, {"layer": "m.layers.1.mlp.experts", "first": first}]
    routes = {"moe": {"layers": ["m.layers.0.mlp.experts", "m.layers.1.mlp.experts"], "experts": 8, "top_k": 2}, "layers": layers}
    block = _output("m.layers.1.mlp", hidden, parted)
    assert block.first_row == 4
    router = moe_origin("m.layers.1.mlp", 1, block, routes)
    assert router is not None and (router["part"], router["token"], router["engine"], router["train"]) == ("router", 2, [1, 3], [1, 5])
    assert "router, sequence 1 token 2: the engine routed it to experts [1, 3], the training side to [1, 5]" in moe_origin_line(router)
    alike = moe_origin("m.layers.0.mlp", 1, _output("m.layers.0.mlp", hidden, parted), routes)
    assert alike is not None and (alike["part"], alike["token"], alike["routed_alike"]) == ("experts", 4, True)
    assert "experts, sequence 1 token 4: routed to the same experts" in moe_origin_line(alike)
    experts = moe_origin("m.layers.0.mlp.experts", 1, _output("m.layers.0.mlp.experts", hidden, parted), routes)
    assert experts is not None and (experts["part"], experts["token"]) == ("experts", 4)
    scores = torch.zeros(6, 8)
    other = scores.clone()
    other[3, 7] = 0.5
    gate = moe_origin("m.layers.0.mlp.gate", 1, _output("m.layers.0.mlp.gate", scores, other), routes)
    assert gate is not None and (gate["part"], gate["token"]) == ("router", 3)  # one score per expert: the router
    shared = moe_origin("m.layers.0.mlp.shared_expert", 1, _output("m.layers.0.mlp.shared_expert", hidden, parted), routes)
    assert shared is not None and (shared["part"], shared["token"]) == ("shared_expert", 4)
    assert moe_origin("m.layers.0.self_attn", 1, _output("m.layers.0.self_attn", hidden, parted), routes) is None
    unrecorded = moe_origin("m.layers.0.mlp", 1, block, {"moe": routes["moe"], "layers": None})
    assert unrecorded is not None and unrecorded["part"] == "router or experts"


def test_the_contract_is_refused_on_an_moe_engine_with_replay_offered() -> None:
    refuse_moe_contract({"steps": []}, "--contract vllm", None)  # a dense model: nothing refused
    with pytest.raises(PrecisionError, match=r"--contract vllm: the model is a mixture of experts \(4 of 16 .*shared.* --replay-routes"):
        refuse_moe_contract({"moe": {"layers": ["a", "b"], "experts": 16, "top_k": 4}}, "--contract vllm", "no shared experts")
