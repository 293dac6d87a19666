"""What a rewrite did to a graph, one record per cast it inserted or retargeted.

    InsertedCast(node, of, frm, to, reason, module, fixes, kind)
        node    the cast's node (or the retargeted / rewritten node)
        of      the value it reads
        kind    CastKind: gather-emulation | source-output | source-operand | weight-read |
                dtype-following | covered-narrowing | engine-contract
        fixes   the source finding's node a source cast answers

Shared by every rewrite, the pipeline, reports and the eager fix: a reader's type, so readers never
import a rewrite to name it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.passes.graph.kinds import CastKind


@dataclass(frozen=True)
class InsertedCast:
    """A cast the pass inserted (or retargeted): ``node`` reads ``of`` at ``frm`` and makes ``to``."""

    node: str
    of: str
    frm: torch.dtype | None
    to: torch.dtype
    reason: str
    module: str
    fixes: str | None = None  # the source finding's node a source cast fixes
    kind: CastKind = CastKind.GATHER
    code: str | None = None  # the FXP code of the finding a source cast fixes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: dtypes by name (``bf16``), the kind by value (``gather-emulation``)."""
        return {**asdict(self), "frm": dtype_name(self.frm), "to": dtype_name(self.to), "kind": str(self.kind)}
