"""The trainer's fixed-shape micro-batches of a step's sequences, and their log-probs in the engine's form.

micro_batches(data, plans, orders, rank, world, size, length)   rank r's sequences (r, r + R, ...), right-padded to
                                                               one shape (one compiled graph), the same count on
                                                               every rank (FSDP2's gathers are collectives)
forward_logprobs(side, batch, form, sampling)                  [rows, length - 1] log-probs of every next token in
                                                               the form the contract read off the engine
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.contract.vocabulary import LogprobForm

if TYPE_CHECKING:
    from fx_precision.contract import EngineContract
    from fx_precision.contract.batch_rows import EngineRows, RowPlan
    from fx_precision.contract.linear_order import LinearOrders
    from fx_precision.dump import Sequence as TokenSequence
    from fx_precision.onpolicy.config import Sampling
    from fx_precision.training_side import TrainingSide


@dataclass
class StepData:
    """What rank 0 sends every rank each step (or the error every rank stops with)."""

    sequences: list[TokenSequence] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # [len - 1] fp32: the engine's
    steps: list[list[tuple[int, int]]] = field(default_factory=list)
    logits_calls: list[tuple[int, int]] = field(default_factory=list)
    contract: EngineContract | None = None  # of this generation (--contract vllm)
    routes: dict[str, Any] | None = None  # an MoE model's: the engine's routes (engine.moe, engine.routes: routes.py)
    error: str | None = None


@dataclass
class MicroBatch:
    """A fixed-shape slice of this rank's sequences: [rows, length] ids, the engine rows, each row's sequence index (-1:
    a dummy row that pads the batch to its fixed size) and prompt length."""

    ids: torch.Tensor
    rows: EngineRows | None  # the engine rows of each row (None: no contract)
    index: list[int]
    prompt_lens: list[int]


def micro_batches(data: StepData, plans: Sequence[RowPlan] | None, orders: LinearOrders | None, rank: int, world: int, size: int,
                  length: int) -> list[MicroBatch]:  # fmt: skip
    """Rank ``rank``'s sequences (``rank::world``) in micro-batches of ``size`` rows x ``length`` positions, right-padded
    (a row's padding is never computed by the engine: row plan 0, causal attention never reaches it); every rank makes
    the same number of micro-batches (FSDP2's gathers are collectives), the short ones padded with dummy rows."""
    from fx_precision.contract.batch_rows import GDN_NONE, EngineRows, RowPlan

    n = len(data.sequences)
    per_rank = -(-n // world)
    count = -(-per_rank // size)
    mine = list(range(rank, n, world))
    batches = []
    for b in range(count):
        index = mine[b * size : (b + 1) * size]
        index = index + [-1] * (size - len(index))
        ids = torch.zeros(size, length, dtype=torch.long)
        row_plans, prompt_lens = [], []
        for r, i in enumerate(index):
            if i < 0:  # a dummy row: nothing the engine computed (a GatedDeltaNet plan of rows never computed where there is one)
                with_gdn = plans is not None and bool(plans) and plans[0].gdn is not None
                row_plans.append(RowPlan((0,), (), None, (GDN_NONE,) if with_gdn else None))
                prompt_lens.append(1)
                continue
            s = data.sequences[i]
            ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
            prompt_lens.append(s.prompt_len)
            if plans is not None:
                row_plans.append(plans[i])
        if plans is not None and orders is None:
            raise ValueError("micro_batches: row plans without the engine's linear orders")
        rows = EngineRows.of(row_plans, orders, length) if plans is not None and orders is not None else None
        batches.append(MicroBatch(ids, rows, index, prompt_lens))
    return batches


def forward_logprobs(side: TrainingSide, batch: MicroBatch, form: LogprobForm, sampling: Sampling) -> torch.Tensor:
    """[rows, length - 1] log-probs of every next token, in ``form`` (the contract's: the log-probs the engine returned)
    after the sampler's temperature, top-k and top-p (``sampling``) where the form is processed (logprobs.py)."""
    from fx_precision.logprobs import token_logprobs

    logits = side.logits(batch.ids, batch.rows)
    return token_logprobs(logits, batch.ids, form, sampling.temperature, batch.prompt_lens, sampling.top_k, sampling.top_p)
