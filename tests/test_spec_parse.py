"""The rule-text grammar: SELECTOR=DTYPES joined by ';' (DESIGN.md)."""

from __future__ import annotations

import pytest
import torch

from fx_precision import DEFAULT, ModuleSel, ParamSel, PrecisionError, Rule, parse_precision_rules
from fx_precision.errors import RuleSyntaxError


def test_design_example_parses_to_three_rules() -> None:
    spec = parse_precision_rules("*embed_tokens=bf16; cls:*RMSNorm=gather:fp32; param:*.A_log=master:fp32")
    assert spec.rules == (
        Rule(ModuleSel(fqn="*embed_tokens"), gather=torch.bfloat16),
        Rule(ModuleSel(cls="*RMSNorm"), gather=torch.float32),
        Rule(ParamSel("*.A_log"), master=torch.float32),
    )


def test_fqn_and_class_selector_and_both_axes() -> None:
    (rule,) = parse_precision_rules("model.layers.*&cls:*DecoderLayer=gather:bf16,master:default").rules
    assert rule.select == ModuleSel(fqn="model.layers.*", cls="*DecoderLayer")
    assert rule.gather is torch.bfloat16 and rule.master is DEFAULT


def test_empty_text_and_empty_segments_give_no_rules() -> None:
    assert len(parse_precision_rules("")) == 0
    assert len(parse_precision_rules(" ; a=fp16 ;")) == 1


@pytest.mark.parametrize(
    ("text", "column", "expected"),
    [
        ("a=bq16", 3, "a dtype"),
        ("a", 1, "SELECTOR=DTYPES"),
        ("=bf16", 1, "a selector"),
        ("a=", 3, "dtypes after '='"),
        ("a=bf16; b=gather:bf16,mastr:fp32", 23, "axis 'gather' or 'master'"),
        ("a=gather:bf16,gather:fp32", 15, "each axis once"),
        ("foo:x=bf16", 1, "unknown prefix"),
        ("a&b=bf16", 3, "'cls:GLOB' after '&'"),
        ("cls:=bf16", 5, "a class-name glob"),
        ("a b=bf16", 2, "a module FQN glob"),
        ("a=bf16,fp32", 7, "one bare dtype"),
    ],
)
def test_malformed_text_names_the_column_and_what_was_expected(text: str, column: int, expected: str) -> None:
    with pytest.raises(RuleSyntaxError) as info:
        parse_precision_rules(text)
    assert info.value.column == column
    assert expected in str(info.value)
    assert f"column {column}" in str(info.value)


def test_rule_needs_an_axis_and_float_dtypes() -> None:
    with pytest.raises(PrecisionError, match="neither gather= nor master="):
        Rule(ModuleSel(fqn="a"))
    with pytest.raises(PrecisionError, match="not a precision dtype; use one of fp32, bf16, fp16"):
        Rule(ModuleSel(fqn="a"), gather=torch.int8)
    with pytest.raises(PrecisionError, match="fqn=, cls="):
        ModuleSel()


def test_rule_text_round_trips_through_the_parser() -> None:
    spec = parse_precision_rules("*embed_tokens=bf16;cls:*Norm=gather:fp32,master:bf16")
    rebuilt = parse_precision_rules(spec.text())
    assert rebuilt.rules == spec.rules
