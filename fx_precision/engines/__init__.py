"""Engine adapters: one package per engine, the only place that engine is known (nothing else imports it).

    ADAPTERS      engine name -> the package holding its adapter (one registration line each)
    engine_adapter(name)  the adapter, its package imported on first use (a live engine's own imports only then)

    vllm          vLLM's CPU build, live in this process (engines/vllm): rollouts, module records, probes, weight sync
    sglang        SGLang's dumper files, read-only (engines/sglang): module outputs under SGLang's names, mapped

The protocol is ``engines/adapter.py``; ``engines/rollout.py`` runs any live adapter into a dump.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from fx_precision.dump import Dump
    from fx_precision.engines.adapter import EngineAdapter

ADAPTERS: dict[str, str] = {
    "vllm": "fx_precision.engines.vllm",
    "sglang": "fx_precision.engines.sglang",
}


def engine_adapter(name: str) -> EngineAdapter:
    """The adapter of engine ``name`` (its package's ``ADAPTER``)."""
    if name not in ADAPTERS:
        raise PrecisionError(f"engine {name!r}: no adapter; the engines are {', '.join(sorted(ADAPTERS))}")
    adapter: EngineAdapter = importlib.import_module(ADAPTERS[name]).ADAPTER
    return adapter


def live_engines() -> list[str]:
    """The engines a rollout can run (the others read dumps an engine wrote)."""
    return [name for name in ADAPTERS if engine_adapter(name).live]


def read_engine_dump(path: str) -> Dump | None:
    """An engine's own dump files at ``path`` as a dump, by the first adapter that recognizes them; None where none does."""
    for name in ADAPTERS:
        found = engine_adapter(name)
        if found.recognizes(path):
            return found.read_dump(path)
    return None


def dump_or_engine_files(path: str) -> str | Dump:
    """A dump directory as it is (compare reads it), or an engine's own dump files an adapter reads (SGLang's dumper)."""
    if os.path.isfile(os.path.join(path, "manifest.json")) or not os.path.isdir(path):
        return path
    return read_engine_dump(path) or path
