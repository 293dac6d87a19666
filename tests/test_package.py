"""The package surface: lazy imports, the four names that are modules callable as their functions."""

from __future__ import annotations

import subprocess
import sys

import torch


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_importing_the_package_or_the_spec_loads_neither_dynamo_nor_fsdp() -> None:
    code = (
        "import sys, fx_precision, fx_precision.spec, fx_precision.plan\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp') if m in sys.modules))"
    )
    assert run(code) == "[]"


def test_the_four_names_are_modules_and_call_as_their_functions() -> None:
    code = (
        "import fx_precision as fxp\n"
        "import fx_precision.lint as lint_module, fx_precision.census, fx_precision.dump, fx_precision.compare\n"
        "from fx_precision.lint import LintReport\n"
        "import types\n"
        "mods = (fxp.lint, fxp.census, fxp.dump, fxp.compare)\n"
        "print(all(isinstance(m, types.ModuleType) and callable(m) for m in mods), lint_module is fxp.lint,\n"
        "      lint_module.LintReport is LintReport, fxp.lint.lint.__name__)"
    )
    assert run(code) == "True True True lint"


def test_the_package_calls_work_before_and_after_a_submodule_import() -> None:
    from torch import nn

    import fx_precision as fxp

    model = nn.Sequential(nn.Linear(4, 4))
    recorded = fxp.dump(model, torch.randn(2, 4))  # the module, called
    assert recorded.records and fxp.dump.dump is not None


def test_every_exported_name_resolves() -> None:
    import fx_precision

    for name in fx_precision.__all__:
        assert getattr(fx_precision, name) is not None, name
