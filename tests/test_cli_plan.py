"""``fx-precision plan`` on tiny Qwen3.5 (a real transformers architecture, random init)."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_cli


@pytest.mark.needs_transformers
def test_plan_table_has_embedding_unit_at_bf16_and_layers_at_default() -> None:
    out = run_cli("plan", "--model", "qwen3_5-tiny", "--rules", "*embed_tokens=bf16", "--wrap", "model.layers.*")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith(("model.", "<root>"))}
    assert rows["model.embed_tokens"][1:2] == ["precision"] and "bf16" in rows["model.embed_tokens"]
    for i in range(4):
        assert rows[f"model.layers.{i}"][1] == "wrap" and "fp32" in rows[f"model.layers.{i}"]
    assert "fp32" in rows["<root>"]
    assert set(rows) == {"model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "<root>"}


@pytest.mark.needs_transformers
def test_plan_json_is_the_same_plan() -> None:
    out = run_cli("plan", "--model", "qwen3_5-tiny", "--rules", "*embed_tokens=bf16", "--wrap", "model.layers.*", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    units = {u["fqn"]: u["gather"] for u in data["units"]}
    assert units == {"model.embed_tokens": "bf16", **{f"model.layers.{i}": "fp32" for i in range(4)}, "": "fp32"}
    assert data["params"]["model.embed_tokens.weight"]["gather_rule"] == "*embed_tokens=bf16"


def test_plan_takes_a_factory_path_and_explains_errors_without_a_traceback() -> None:
    out = run_cli("plan", "--model", "tests.model_trees:Net", "--rules", "embed=bf16", "--json")
    assert out.returncode == 0, out.stderr
    assert {u["fqn"]: u["gather"] for u in json.loads(out.stdout)["units"]} == {"embed": "bf16", "": "fp32"}
    bad = run_cli("plan", "--model", "tests.model_trees:Nope")
    assert bad.returncode == 2 and "cannot import 'Nope'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.needs_transformers
def test_plan_with_a_misspelt_rule_exits_nonzero_and_suggests() -> None:
    out = run_cli("plan", "--model", "qwen3_5-tiny", "--rules", "*embed_tokenz=bf16")
    assert out.returncode != 0
    assert "*embed_tokenz=bf16" in out.stderr and "model.embed_tokens" in out.stderr


def test_the_cli_is_its_table_of_verbs() -> None:
    """Every subcommand the parser knows is one entry of VERBS (no verb added beside the table), each runs the
    function its entry names, and its runner and flags sit in the module of its half (tools/cli/<half>_verbs.py)."""
    import argparse

    from fx_precision.tools.cli import VERBS, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == [v.name for v in VERBS]
    for verb in VERBS:
        assert sub.choices[verb.name].get_default("handler") is verb.run, verb.name
        assert verb.run.__module__ == verb.flags.__module__, verb.name
        assert verb.run.__module__.rsplit(".", 1)[-1].endswith("_verbs"), verb.name
