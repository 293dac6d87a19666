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


def _module_imports() -> dict[str, set[str]]:
    """fx_precision module -> the fx_precision modules it imports, at module level or inside a function (a deferred
    import is still an edge: deferring one to dodge a circle hides the circle); TYPE_CHECKING blocks excluded."""
    import ast
    from pathlib import Path

    import fx_precision

    root = Path(fx_precision.__file__).parent
    dotted = {p: ".".join(("fx_precision", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): p for p, name in dotted.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())  # type-only imports (under TYPE_CHECKING) count: a circle in types is a circle
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fx_precision"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                found |= {t for t in targets if t in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def test_only_the_vllm_adapter_imports_vllm() -> None:
    """The engine seam: vLLM (module- or function-level imports) is known inside fx_precision/engines/vllm only."""
    import ast
    from pathlib import Path

    import fx_precision

    root = Path(fx_precision.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers and all(p.startswith("engines/vllm/") for p in importers), sorted(importers)


def test_no_import_circle_and_the_layers_import_downwards() -> None:
    graph = _module_imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles
    for name, deps in graph.items():
        if name.startswith(("fx_precision.passes.graph", "fx_precision.passes.rules")):
            assert not {d for d in deps if d.startswith("fx_precision.passes.rewrites")}, (name, deps)  # readers never import rewrites
        if not name.startswith("fx_precision.tools") and name != "fx_precision.__main__":  # the entry point runs the CLI
            assert not {d for d in deps if d.startswith("fx_precision.tools")}, (name, deps)  # the core never imports the tools
        if name.startswith("fx_precision.passes"):
            assert not deps & {"fx_precision.policy", "fx_precision.fsdp", "fx_precision.backend", "fx_precision.lint"}, (name, deps)


def test_the_tested_transformers_range_is_one_range_everywhere() -> None:
    """The dev extra's lower bound, the release CI runs the suite on again, the README's command and the range the
    one-line model-code failure names are one; neither extra caps transformers (users of [hf] get the newest)."""
    import re
    from pathlib import Path

    from fx_precision.hf import TESTED_TRANSFORMERS

    root = Path(__file__).parents[1]
    pins = dict(re.findall(r'^(\w+) = \[.*?"(transformers[^"]*)"', (root / "pyproject.toml").read_text(), re.M))  # extra -> its pin
    assert set(pins) >= {"hf", "dev"} and all("<" not in pin for pin in pins.values()), pins
    floors = {pin.removeprefix("transformers>=") for pin in pins.values()}
    (floor,) = floors
    ci = re.findall(r"transformers==([\d.]+)", (root / ".ci" / "run").read_text())
    readme = re.findall(r"pip install transformers==([\d.]+)", (root / "README.md").read_text())
    assert ci and readme and {*ci, *readme} == {f"{floor}.0" if floor.count(".") == 1 else floor}, (floor, ci, readme)
    assert TESTED_TRANSFORMERS.startswith(ci[0] + " to "), TESTED_TRANSFORMERS


def test_no_tool_resets_dynamo_in_the_callers_process() -> None:
    """A reset drops every compiled frame of the process, the caller's too: the sweep, the bench and the comparator's taps
    compile with backends of their own instead (Dynamo keeps a frame per backend, so each traces afresh)."""
    import ast
    from pathlib import Path

    import fx_precision

    resets = ("torch._dynamo", "torch.compiler", "_dynamo")
    found = []
    for path in Path(fx_precision.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "reset" and ast.unparse(node.value) in resets:
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
