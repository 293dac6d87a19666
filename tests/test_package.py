"""The package surface: lazy imports, names that are functions and modules alike, moved paths."""

from __future__ import annotations

import subprocess
import sys
import warnings

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


def test_functions_keep_their_names_after_their_submodules_are_imported() -> None:
    code = (
        "import fx_precision as fxp\n"
        "import fx_precision.lint, fx_precision.census, fx_precision.dump, fx_precision.compare\n"
        "from fx_precision.lint import LintReport\n"
        "print(all(callable(f) and not isinstance(f, type(fxp)) for f in (fxp.lint, fxp.census, fxp.dump, fxp.compare)))"
    )
    assert run(code) == "True"


def test_every_exported_name_resolves() -> None:
    import fx_precision

    for name in fx_precision.__all__:
        assert getattr(fx_precision, name) is not None, name


def test_moved_tool_modules_import_from_their_old_paths_with_a_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fx_precision.tools.zoo as new

        old = __import__("fx_precision.toy_decoder", fromlist=["ToyDecoder"])
    assert old.ToyDecoder is __import__("fx_precision.tools.toy_decoder", fromlist=["ToyDecoder"]).ToyDecoder
    assert new.build_model is not None
    assert any(issubclass(w.category, DeprecationWarning) and "fx_precision.tools.toy_decoder" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fx_precision.plan import compile_precision
    assert callable(compile_precision) and any("fx_precision.lowering" in str(w.message) for w in caught)


def test_the_old_cast_query_of_graph_reports_still_works_with_a_warning() -> None:
    from fx_precision.backend import GraphReport
    from fx_precision.passes.gather_emulation import InsertedCast
    from fx_precision.passes.kinds import CastKind

    cast = InsertedCast("to_1", "w", torch.float32, torch.bfloat16, "gather emulation: unit <root>", "", kind=CastKind.GATHER)
    report = GraphReport(0, "enforce", torch.bfloat16, casts=[cast])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert report.casts_for("gather emulation") == [cast] == report.gather_casts
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
