"""Test-wide switches: which tests need ``transformers`` (the dev extra), and running without it;
``tests/engine`` is collected only where vLLM is installed (the engine environment).

``@pytest.mark.needs_transformers`` marks a test that builds a transformers architecture; it is
skipped, with the reason, where transformers is not installed. ``--without-transformers`` hides
the package for the run, so that every other test is shown to stand alone. The summary line at
the end counts both.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest

_COUNTS: dict[str, int] = {}
ENGINE = importlib.util.find_spec("vllm") is not None
# tests/engine needs a live vLLM: collected in the engine environment only (python -m fx_precision.tools.engine_env)
collect_ignore = [] if ENGINE else ["engine"]

# Under pytest-xdist (`-n 2`) each worker takes its share of the cores: torch's threads, its spawned ranks'
# (OMP_NUM_THREADS is inherited) and Inductor's compile workers (one in-process compile, no worker pool to
# start). Set before torch is imported, so every layer reads it. Not in the engine environment: there the thread
# counts are what the tests are about (the engine's as users launch it, the trainer's ranks' as they take them), so
# its workers share the cores instead of each running on fewer threads (they overlap the engine's one-threaded
# start and compile; README, Tests).
if os.environ.get("PYTEST_XDIST_WORKER") and not ENGINE:
    _share = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="the sweep over every architecture of the zoo (the default run sweeps one per family of patterns)",
    )
    parser.addoption(
        "--without-transformers",
        action="store_true",
        help="hide the transformers package (as on an install without the dev extra); tests that need it are skipped",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_transformers: builds a transformers architecture (the dev extra installs it)")
    if config.getoption("--without-transformers"):
        sys.modules["transformers"] = None  # type: ignore[assignment]  # `import transformers` now raises ImportError


def _transformers_missing(config: pytest.Config) -> bool:
    return bool(config.getoption("--without-transformers")) or importlib.util.find_spec("transformers") is None


# The longest file (its module fixture sweeps one architecture per family) runs first: under
# `-n auto --dist loadfile` a worker takes it at the start instead of the others waiting on it at the end.
FIRST = ("test_sweep.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the order within each group is kept
    missing = _transformers_missing(config)
    skip = pytest.mark.skip(reason="needs transformers: pip install -e '.[dev]'")
    needing = [item for item in items if "needs_transformers" in item.keywords]
    if missing:
        for item in needing:
            item.add_marker(skip)
    _COUNTS.update(total=len(items), needing=len(needing), missing=int(missing))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from nothing, as a user's process does: Dynamo's caches and recompile counts are per code
    object and process-wide, so the models earlier tests on the same worker compiled (under `--dist loadfile`, whatever
    files the worker drew) would count against this test's limit, and past it Dynamo runs the frame eagerly, without
    the backend's passes. Past the limit inside one test: an error, never a silent eager run."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: hand the counts to the controller
    if workeroutput is not None:
        workeroutput["fx_precision_counts"] = dict(_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _COUNTS.update(getattr(node, "workeroutput", {}).get("fx_precision_counts", {}))  # every worker collects every test


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _COUNTS:
        return
    total, needing = _COUNTS["total"], _COUNTS["needing"]
    state = "hidden or absent: those were skipped" if _COUNTS["missing"] else "installed"
    terminalreporter.write_line(
        f"fx_precision: {total} tests collected; {total - needing} run without transformers, {needing} need it ({state})"
    )
    if not ENGINE:
        terminalreporter.write_line(
            "fx_precision: tests/engine not collected: vLLM is not installed here; they run in the engine environment "
            "(python -m fx_precision.tools.engine_env .venv-engine && "
            ".venv-engine/bin/python -m pytest tests/engine -q -n 2 --dist loadfile)"
        )
