"""Every bad input is a clear error, raised before anything changes; reach: torchrun, config paths."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import fx_precision as fxp
from fx_precision.plan import PrecisionPlan
from fx_precision.tools.toy_decoder import ToyDecoder
from tests import lint_models as lm
from tests.cli import run_cli, run_torchrun
from tests.model_trees import Net

CONFIGS = Path(__file__).parent / "configs"


def one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-1500:])
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr[-1500:])


# 1 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("lint", "--model", "toy-decoder", "--fail-on", "bogus", "--json"),
        ("plan", "--model", "toy-decoder", "--no-such-flag", "--json"),
        ("census", "--model", "toy-decoder", "--world-size", "two", "--json"),
        ("frobnicate", "--json"),
    ],
)
def test_argument_errors_with_json_print_an_error_object_on_stdout(args: tuple[str, ...]) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert set(json.loads(out.stdout)) == {"error"}


# 2 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("os:system", "building the model raised TypeError"),
        (":", "expected package.module:factory"),
        ("tests.test_hardening:raising_factory", "building the model raised RuntimeError: no weights"),
        ("torch.nn:Linear", "building the model raised TypeError"),
    ],
)
def test_model_factory_failures_are_one_line_errors(model: str, needle: str) -> None:
    one_line_error(run_cli("plan", "--model", model), needle)


def raising_factory() -> nn.Module:
    raise RuntimeError("no weights")


class RaisingForward(ToyDecoder):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("broken forward")


def test_a_model_whose_forward_raises_is_a_one_line_error() -> None:
    one_line_error(run_cli("lint", "--model", "tests.test_hardening:RaisingForward"), "raised", "broken forward")
    one_line_error(run_cli("census", "--model", "tests.test_hardening:RaisingForward", "--compute", "none"), "broken forward")


# 3 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", ["-3", "0", "1099511627776", "12345678901234567890123"])
def test_sequence_length_is_bounded_where_it_is_read(seq_len: str) -> None:
    out = run_cli("census", "--model", "toy-decoder", "--seq-len", seq_len)
    one_line_error(out, "--seq-len")


@pytest.mark.needs_transformers  # the bound comes from the checkpoint's transformers config
def test_sequence_longer_than_the_model_positions_is_refused() -> None:
    one_line_error(run_cli("lint", "--model", str(CONFIGS / "llama-3-8b"), "--seq-len", "9000"), "max_position_embeddings=8192")


@pytest.mark.parametrize(
    "args",
    [
        ("bench", "--model", "toy-decoder", "--steps", "0"),
        ("bench", "--model", "toy-decoder", "--batch", "0"),
        ("bench", "--model", "toy-decoder", "--seq-len", "0"),
        ("bench", "--model", "toy-decoder", "--steps", "-2"),
        ("census", "--model", "toy-decoder", "--top", "-1"),
        ("census", "--model", "toy-decoder", "--world-size", "64"),
    ],
)
def test_counts_out_of_range_name_the_limit(args: tuple[str, ...]) -> None:
    out = run_cli(*args)
    assert out.returncode == 2 and "is outside" in out.stderr, out.stderr[-800:]


# 4 -------------------------------------------------------------------------------------------------
def test_lint_dot_into_a_missing_folder_fails_before_the_work() -> None:
    one_line_error(run_cli("lint", "--model", "toy-decoder", "--dot", "/nonexistent/dir/x.dot"), "/nonexistent/dir")


# 5 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args", [("--gather", "int64"), ("--master", "int8"), ("--gather", "fp8e4m3"), ("--gather", "fp64"), ("--rules", "embed=fp64")]
)
def test_only_fp32_bf16_fp16_are_precision_dtypes(args: tuple[str, ...]) -> None:
    out = run_cli("plan", "--model", "tests.model_trees:Net", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "fp32" in out.stderr and "bf16" in out.stderr, out.stderr[-500:]


def test_dtype_flags_take_any_name_and_parse_before_any_work() -> None:
    """Parsed by argparse (dtype_arg): ``bfloat16`` is ``bf16``; a bad name is an argument error naming the flag."""
    out = run_cli("plan", "--model", "tests.model_trees:Net", "--gather", "bfloat16", "--master", "float32", "--json")
    assert out.returncode == 0, out.stderr[-500:]
    data = json.loads(out.stdout)
    assert (data["default_gather"], data["default_master"]) == ("bf16", "fp32")
    one_line_error(run_cli("census", "--model", "toy-decoder", "--compute", "fp8e4m3"), "argument --compute", "--compute=fp8e4m3")


def test_rules_and_policies_reject_float8_and_float64() -> None:
    for dtype in (torch.float8_e4m3fn, torch.float64, torch.int64):
        with pytest.raises(fxp.PrecisionError, match="not a precision dtype"):
            fxp.Rule(fxp.ModuleSel(fqn="embed"), gather=dtype)
        with pytest.raises(fxp.PrecisionError, match="this axis takes fp32, bf16, fp16"):
            fxp.PrecisionPolicy(gather=dtype)
    one_line_error(run_cli("census", "--model", "toy-decoder", "--gather", "fp8e4m3"), "--gather=fp8e4m3")


# 6 -------------------------------------------------------------------------------------------------
def test_a_compute_dtype_autocast_would_not_run_is_refused() -> None:
    one_line_error(run_cli("lint", "--model", "toy-decoder", "--compute", "fp64"), "--compute=fp64: this axis takes bf16, fp16")
    with pytest.raises(fxp.PrecisionError, match=r"PrecisionPolicy\.compute=fp32"):
        fxp.PrecisionPolicy(compute=torch.float32)


def test_lint_and_census_on_cuda_need_a_cuda_device() -> None:
    out = run_cli("lint", "--model", "toy-decoder", "--device-type", "cuda")
    census = run_cli("census", "--model", "toy-decoder", "--device", "cuda")
    if torch.cuda.is_available():
        assert out.returncode in (0, 1) and census.returncode == 0, out.stderr[-800:] + census.stderr[-800:]  # real cuda runs
    else:
        one_line_error(out, "sees no CUDA device")
        one_line_error(census, "sees no CUDA device")


# 7 -------------------------------------------------------------------------------------------------
def _plan_json(model: nn.Module) -> dict:
    plan = fxp.compile_precision(model, fxp.parse_precision_rules("embed=bf16"), default_gather="fp32", wrap=["layers.*"])
    return json.loads(plan.to_json())


def _mutations(data: dict) -> dict[str, object]:
    embed_unit = next(i for i, u in enumerate(data["units"]) if u["fqn"] == "embed")
    no_root = {**data, "units": [u for u in data["units"] if u["fqn"] != ""]}
    embed_at_fp32 = {**data["params"]["embed.weight"], "gather": "fp32"}
    return {
        "does not parse": json.dumps(data)[:40],
        "must be an object": [],
        "version": {},
        "lacks the field": {k: v for k, v in data.items() if k != "units"},
        "wrong type": {**data, "params": 3},
        "is not a precision dtype": {**data, "units": [{**u, "gather": "int64"} if u["fqn"] == "embed" else u for u in data["units"]]},
        "appears twice": {**data, "units": [data["units"][embed_unit], *data["units"]]},
        "exactly one root unit": no_root,
        "needs exactly one root unit": {**data, "units": []},
        "gathers at fp32 but its unit": {**data, "params": {**data["params"], "embed.weight": embed_at_fp32}},
        "not a module of this model": {**data, "units": [{**u, "fqn": "nowhere"} if u["fqn"] == "embed" else u for u in data["units"]]},
        "unknown kind": {**data, "units": [{**u, "kind": "magic"} if u["fqn"] == "embed" else u for u in data["units"]]},
    }


@pytest.mark.parametrize("defect", list(_mutations(_plan_json(Net()))))
def test_plan_json_that_is_malformed_or_inconsistent_is_rejected(defect: str) -> None:
    model = Net()
    bad = _mutations(_plan_json(model))[defect]
    with pytest.raises(fxp.PrecisionError, match=defect):
        PrecisionPlan.from_json(bad, model)  # type: ignore[arg-type]


# 8 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("defect", ["master int64", "mesh None without a process group", "mesh bogus", "duplicate unit"])
def test_apply_fsdp2_changes_nothing_before_it_fails(defect: str) -> None:
    from tests.model_state import model_snapshot, same_model_state

    model = ToyDecoder().to(torch.bfloat16)
    plan = fxp.compile_precision(model, fxp.parse_precision_rules(""), default_gather="fp32", default_master="fp32")
    mesh: object = None
    if defect == "master int64":
        first = next(iter(plan.params.values()))
        plan = replace(plan, params={**plan.params, first.fqn: replace(first, master=torch.int64)})
    elif defect == "mesh bogus":
        mesh = "bogus"
    elif defect == "duplicate unit":
        plan = replace(plan, units=(plan.units[0], *plan.units))
    before = model_snapshot(model)
    with pytest.raises(fxp.PrecisionError):
        fxp.apply_fsdp2(model, plan, mesh=mesh)
    assert same_model_state(before, model_snapshot(model))


# 9 -------------------------------------------------------------------------------------------------
def test_lint_and_backend_refuse_a_plan_of_another_model() -> None:
    toy = ToyDecoder()
    foreign = fxp.compile_precision(Net(), fxp.parse_precision_rules("embed=bf16"), default_gather="fp32")
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(fxp.PrecisionError, match="does not match this model"), torch.autocast("cpu", dtype=torch.bfloat16):
        fxp.lint(toy, ids, plan=foreign)
    backend = fxp.make_precision_backend(plan=foreign, inner="aot_eager")
    with pytest.raises(Exception) as info, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(toy, backend=backend)(ids)
    error = getattr(info.value, "inner_exception", info.value)
    assert isinstance(error, fxp.PrecisionError) and "belongs to another model" in str(error)


# 10 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device_type", ["meta", "tpu"])
def test_lint_names_the_device_types_with_autocast_op_lists(device_type: str) -> None:
    with pytest.raises(fxp.PrecisionError, match="'cpu' and 'cuda'"):
        fxp.lint(ToyDecoder(), torch.randint(0, 128, (2, 8)), device_type=device_type)


@pytest.mark.parametrize("inner", ["bogus", 42])
def test_a_bad_inner_compiler_fails_when_the_backend_is_made(inner: object) -> None:
    with pytest.raises(fxp.PrecisionError, match="inner="):
        fxp.make_precision_backend(inner=inner)  # type: ignore[arg-type]


def test_wrap_given_as_a_string_says_to_pass_a_list() -> None:
    with pytest.raises(fxp.PrecisionError, match=r"is a string; pass a list of globs"):
        fxp.compile_precision(Net(), default_gather="fp32", wrap="layers.*")  # type: ignore[arg-type]


# 11 ------------------------------------------------------------------------------------------------
def test_a_policy_compute_that_did_not_run_enforces_nothing_and_says_so() -> None:
    torch.manual_seed(0)
    model = lm.EmbedLlamaNorm()
    ids = torch.randint(0, 32, (2, 4))
    want = model(ids)
    backend = fxp.make_precision_backend(policy=fxp.PrecisionPolicy(compute=torch.bfloat16), inner="aot_eager")
    got = torch.compile(model, backend=backend)(ids)  # no autocast around the call
    assert torch.equal(got, want) and got.dtype == torch.float32
    (report,) = backend.reports
    assert report.casts == [] and report.compute is None and "traced without autocast: nothing enforced" in report.note


# 12 ------------------------------------------------------------------------------------------------
def test_multi_line_rule_text_points_at_the_line_and_column() -> None:
    with pytest.raises(fxp.PrecisionError, match=r"line 2, column 15") as info:
        fxp.parse_precision_rules("a=bf16;\nb=gather:bf16,mastr:fp32")
    assert "\n  b=gather:bf16,mastr:fp32\n" + " " * 16 + "^" in str(info.value)


def test_wrap_help_says_what_the_default_is() -> None:
    out = run_cli("plan", "--help")
    assert "default none: the root and precision units only" in " ".join(out.stdout.split())


# reach ---------------------------------------------------------------------------------------------
@pytest.mark.needs_transformers
def test_torchrun_census_prints_rank_0_with_the_1_rank_counts() -> None:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    launched = run_torchrun(2, "census", "--model", "qwen3_5-tiny", "--json", env=env)
    assert launched.returncode == 0, launched.stderr[-3000:]
    two = json.loads(launched.stdout)  # one JSON document: rank 1 printed nothing
    one = json.loads(run_cli("census", "--model", "qwen3_5-tiny", "--json").stdout)
    assert two["launcher"] is True and two["world_size"] == 2
    assert two["totals"] == one["totals"] and two["totals"]["fp32"] > 0


@pytest.mark.needs_transformers
@pytest.mark.parametrize(("config", "units"), [("qwen3.5-4b", 2), ("llama-3-8b", 2), ("qwen3-0.6b", 2)])
def test_model_path_builds_a_checkpoint_config_on_meta(config: str, units: int) -> None:
    out = run_cli("plan", "--model", str(CONFIGS / config), "--rules", "*embed_tokens=bf16", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    assert len(plan["units"]) == units and plan["units"][-1]["fqn"] == ""
    embed = next(u for u in plan["units"] if u["fqn"] == "model.embed_tokens")
    assert embed["gather"] == "bf16"
    assert embed["kind"] == ("group" if config == "qwen3-0.6b" else "precision")  # Qwen3-0.6B ties lm_head to the embedding


@pytest.mark.needs_transformers
def test_lint_on_a_checkpoint_config_lists_the_masked_norms() -> None:
    out = run_cli("lint", "--model", str(CONFIGS / "qwen3-0.6b"), "--batch", "1", "--seq-len", "8", "--json")
    assert out.returncode == 1, out.stderr[-2000:]
    (graph,) = json.loads(out.stdout)["graphs"]
    sources = [f for f in graph["findings"] if f["kind"] in ("uncovered-op", "weight-promotion")]
    assert sources[0]["module"] == "model.embed_tokens" and sum(f["round"] > 0 for f in sources) >= 28 * 2
