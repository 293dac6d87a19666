"""How an inference engine ran, typed: what its adapter's ``describe()`` returns and a dump's ``engine`` record holds.

    EngineDescription                     one engine's launch, build and machine (fields below)
    ├── to_dict() / from_dict(d, where)    JSON out and in by the field types (json_record.py): the wire between
    │                                      the engine server and its client, the on-policy run's ``engine`` record
    └── of_run(record)                    the description inside a dump's ``engine`` record, which holds the run's
                                          own fields beside it (its steps, logits calls, sampler settings, routes)

An engine adapter fills what it knows; a field it does not know keeps its default (None, or the neutral value),
and every reader treats that default as "not recorded", never as a fact about the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fx_precision.json_record import JsonRecord


@dataclass(frozen=True)
class EngineDescription(JsonRecord):
    """One engine as it ran. Identity: ``name``, ``version``, ``package``, ``model_class``, ``checkpoint``, ``weights``
    (the digest of what it runs now) and where those weights came from. Launch: ``launch`` (defaults | eager),
    ``custom_ops``, ``compilation_mode``, ``compiled``, ``prefix_caching``, ``logprobs`` (raw | processed),
    ``max_model_len``, ``kv_cache_gib``, ``threads``. Kernels and machine: ``kernels`` (its kernel build),
    ``cpu_family`` (as run; ``native_family`` the machine's), ``onednn_max_isa``, ``aten_capability``, ``cpu_flags``,
    the attention backend, ISA, block size, window, head dim, L2 size and split-KV (what its KV tiles follow from),
    the compiled engine's Inductor build and the norm reductions read off its code, its GatedDeltaNet layers
    (``gdn``), and how often its norms were called with and without a residual (``norm_calls``)."""

    name: str = ""
    version: str = ""
    package: str | None = None
    dtype: str = "bf16"
    model_class: str | None = None
    checkpoint: str | None = None
    weights: str | None = None
    weights_source: str | None = None
    launch: str | None = None
    custom_ops: str | None = None
    compilation_mode: str | None = None
    compiled: bool = False
    prefix_caching: bool = False
    logprobs: str = "raw"
    max_model_len: int | None = None
    kv_cache_gib: int | None = None
    threads: int = 1
    start_seconds: float | None = None
    kernels: str | None = None
    cpu_family: str | None = None
    native_family: str | None = None
    onednn_max_isa: str | None = None
    aten_capability: str | None = None
    cpu_flags: tuple[str, ...] = ()
    attention_backend: str | None = None
    attention_isa: str | None = None
    block_size: int | None = None
    attention_window: int = -1  # -1: none
    head_dim: int | None = None
    l2_cache_bytes: int | None = None
    split_kv: bool = False
    inductor: str | None = None
    inductor_norms: tuple[dict[str, Any], ...] | None = None
    inductor_norms_why: str | None = None
    inductor_code: str | None = None
    gdn: dict[str, Any] | None = None
    norm_calls: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_run(cls, record: Mapping[str, object] | None, where: str = "engine") -> EngineDescription:
        """The description in a dump's ``engine`` record (its fields, each checked against its type; the run's own
        fields beside them left to their readers). An empty record (a dump of an engine this does not launch) gives
        the defaults: nothing recorded."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({k: v for k, v in (record or {}).items() if k in names}, where)

    def label(self) -> str:
        """``name version (kernels)``: how a report names the engine."""
        return f"{self.name} {self.version} ({self.kernels or ''})"
