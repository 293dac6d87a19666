"""What an on-policy step certifies and measures, and what a run did.

    certify(data, recompute, forward) -> Certificate    the sampled tokens' log-probs as bit patterns: the rollout's,
                                                        the recompute's and the first training forward's; prompt
                                                        tokens counted apart; |delta| in log-prob and probability,
                                                        ratio range, k3 KL; non-finite values counted, never equal
    StepMetrics                                         one step: its certificate, reward, loss, time split, and what
                                                        was not finite (a step that saw NaN or Inf learned nothing)
    OnPolicyRun                                         the run: config, engine, steps, where and why it stopped

The JSON (``OnPolicyRun.to_dict``) carries each step's figures under this project's names and, beside them, under
the names RL frameworks log the same quantities by (``STANDARD_NAMES``), so a run reads in their dashboards' terms.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.bit_equality import bit_equal
from fx_precision.engine_description import EngineDescription

if TYPE_CHECKING:
    from fx_precision.onpolicy.batches import StepData

# the names RL frameworks log a trainer-vs-rollout quantity under -> this project's field
STANDARD_NAMES: dict[str, str] = {
    "sampling/sampling_logp_difference/max": "max_delta",  # TRL (GRPO with vLLM): max |log p_train - log p_rollout|
    "sampling/sampling_logp_difference/mean": "mean_delta",  # TRL: its mean over sampled tokens
    "training/rollout_probs_diff_max": "max_prob_delta",  # verl: max |p_train - p_rollout|
    "training/rollout_probs_diff_mean": "mean_prob_delta",  # verl: its mean
    "rollout_corr/k3_kl": "k3_kl",  # verl's rollout correction: the k3 estimate of KL(rollout || train)
    "sampling/importance_sampling_ratio/min": "ratio_min",  # TRL: p_train / p_rollout over sampled tokens
    "sampling/importance_sampling_ratio/mean": "ratio_mean",
    "sampling/importance_sampling_ratio/max": "ratio_max",
    "training/rollout_probs_diff_std": "std_prob_delta",  # verl: the std of |p_train - p_rollout|
    "rollout_corr/kl": "k1_kl",  # verl: the k1 estimate of KL(rollout || train), mean of log p_rollout - log p_train
    "train/train_rollout_logprob_abs_diff": "mean_delta",  # slime: mean |log p_train - log p_rollout|
}


@dataclass(frozen=True)
class FirstMismatch:
    """The first sampled token whose three log-probs are not one bit pattern."""

    sequence: int
    token: int  # position in the sequence
    token_id: int
    rollout: float
    recompute: float
    first_forward: float


@dataclass(frozen=True)
class Certificate:
    """One step's comparison of the rollout's, the recompute's and the first training forward's log-probs."""

    tokens: int  # sampled tokens certified
    mismatches: int  # sampled tokens whose three log-probs are not one bit pattern
    recompute_mismatches: int  # rollout vs recompute
    forward_mismatches: int  # recompute vs the first training forward
    prompt_tokens: int
    prompt_mismatches: int  # prompt tokens (the engine's prompt log-probs vs the recompute's): reported, not in the loss
    max_delta: float  # max |log p_first_forward - log p_rollout| over finite pairs
    mean_delta: float
    max_prob_delta: float  # the same in probability
    mean_prob_delta: float
    ratio_min: float
    ratio_max: float
    k3_kl: float
    non_finite: int  # sampled tokens whose rollout or training log-prob is NaN or Inf (never equal)
    first: FirstMismatch | None = None
    ratio_mean: float = float("nan")  # of p_train / p_rollout over finite pairs
    k1_kl: float = float("nan")  # mean of log p_rollout - log p_train
    std_prob_delta: float = float("nan")  # the std of |p_train - p_rollout| (population)


def certify(
    data: StepData, recompute: dict[int, torch.Tensor], forward: dict[int, torch.Tensor], prompt_recorded: bool = True
) -> Certificate:
    """Bit patterns of the sampled tokens' log-probs: rollout vs recompute vs the first training forward (``data``: the
    step's sequences and the engine's log-probs); prompt tokens (rollout vs recompute) counted apart, where the engine
    was asked for them (``prompt_recorded``; else none is counted: not recorded is never "equal" nor a mismatch)."""
    from fx_precision.onpolicy.grpo import ratio_stats

    tokens = prompt_tokens = m_rec = m_fwd = m_all = m_prompt = non_finite = 0
    first = None
    train_all, roll_all = [], []
    for i, s in enumerate(data.sequences):
        engine = data.logprobs[i].float()
        n = len(s.tokens) - 1
        rec, fwd = recompute[i][:n], forward[i][:n]
        sampled = slice(s.prompt_len - 1, n)
        e, r, f = engine[sampled], rec[sampled], fwd[sampled]
        bad_rec = ~bit_equal(e, r)
        bad_fwd = ~bit_equal(r, f)
        finite = torch.isfinite(e) & torch.isfinite(r) & torch.isfinite(f)
        bad = bad_rec | bad_fwd | ~finite  # a NaN is never equal, whatever its bits
        tokens += int(e.numel())
        m_rec += int((bad_rec | ~finite).sum())
        m_fwd += int((bad_fwd | ~finite).sum())
        m_all += int(bad.sum())
        non_finite += int((~finite).sum())
        if first is None and bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            first = FirstMismatch(i, s.prompt_len + t, int(s.tokens[s.prompt_len + t]), float(e[t]), float(r[t]), float(f[t]))
        pe, pr = (engine[: s.prompt_len - 1], rec[: s.prompt_len - 1]) if prompt_recorded else (engine[:0], rec[:0])
        prompt_tokens += int(pe.numel())
        m_prompt += int((~bit_equal(pe, pr) | ~(torch.isfinite(pe) & torch.isfinite(pr))).sum())
        train_all.append(f[finite])
        roll_all.append(e[finite])
    train, roll = (torch.cat(train_all), torch.cat(roll_all)) if train_all else (torch.empty(0), torch.empty(0))
    delta = (train.double() - roll.double()).abs()
    prob_delta = (train.double().exp() - roll.double().exp()).abs()
    empty = delta.numel() == 0
    stats = ratio_stats(train, roll)
    return Certificate(
        tokens, m_all, m_rec, m_fwd, prompt_tokens, m_prompt,
        0.0 if empty else float(delta.max()), 0.0 if empty else float(delta.mean()),
        0.0 if empty else float(prob_delta.max()), 0.0 if empty else float(prob_delta.mean()),
        stats["ratio_min"], stats["ratio_max"], stats["k3_kl"], non_finite, first, stats["ratio_mean"], stats["k1_kl"],
        0.0 if empty else float(prob_delta.std(unbiased=False)),
    )  # fmt: skip


@dataclass
class StepMetrics:
    """One step (module docstring): the table's row, metrics.json's entry."""

    step: int
    sequences: int
    certificate: Certificate
    reward: float
    loss: float
    fixed_logprobs: str  # digest of the fixed sequence's log-probs: differs between steps when the weights did
    weights: str  # the tensors_digest the engine reported for what it loaded
    seconds: dict[str, float]
    groups_with_signal: int = 0  # prompt groups whose rewards differ (a group of equal rewards has no gradient)
    non_finite: str | None = None  # what was NaN or Inf this step (log-probs, loss, rewards); None: everything finite

    @property
    def tokens(self) -> int:
        return self.certificate.tokens

    @property
    def mismatches(self) -> int:
        return self.certificate.mismatches

    @property
    def learned(self) -> bool:
        """Whether the step's reward and update mean anything: every value it saw was finite."""
        return self.non_finite is None

    def standard(self) -> dict[str, float]:
        """The step's figures under the names RL frameworks log them by (``STANDARD_NAMES``)."""
        return {name: float(getattr(self.certificate, field)) for name, field in STANDARD_NAMES.items()}

    def row(self) -> dict[str, Any]:
        c = self.certificate
        return {
            "step": self.step, "mismatch": c.mismatches, "of": c.tokens, "max |delta|": c.max_delta, "ratio min": c.ratio_min,
            "ratio max": c.ratio_max, "k3": c.k3_kl, "reward": round(self.reward, 4) if self.learned else f"not finite: {self.non_finite}",
            "groups learning": self.groups_with_signal, "loss": round(self.loss, 5),
            **{f"{k} s": round(v, 3) for k, v in self.seconds.items()},
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        c = dataclasses.asdict(self.certificate)
        first = c.pop("first")
        flat = {k: v for k, v in dataclasses.asdict(self).items() if k != "certificate"}
        return {**flat, **c, "first_mismatch": first, "standard": self.standard()}


@dataclass
class OnPolicyRun:
    """What a run did: its config (as JSON), the engine it ran, every step's metrics, and where it stopped."""

    config: dict[str, Any]
    engine: EngineDescription | None  # None until the engine started
    contract: str | None
    steps: list[StepMetrics]
    stopped: str | None = None  # why the run stopped before its last step (strict mode's first mismatch, a non-finite step)
    out: str = ""
    origin: dict[str, Any] | None = None  # strict mode with modules: the comparator's first origin module and op

    def to_dict(self) -> dict[str, Any]:
        engine = self.engine.to_dict() if self.engine is not None else None
        return {
            "config": self.config, "engine": engine, "contract": self.contract, "stopped": self.stopped, "out": self.out,
            "origin": self.origin, "steps": [s.to_dict() for s in self.steps], "summary": self.summary(),
            "standard_names": STANDARD_NAMES,
        }  # fmt: skip

    def median_seconds(self, *phases: str) -> float:
        """The median over steps 1.. (step 0 compiles; a one-step run: that step) of the phases' summed seconds."""
        later = self.steps[1:] or self.steps
        return statistics.median(sum(s.seconds.get(p, 0.0) for p in phases) for s in later) if later else float("nan")

    def summary(self) -> dict[str, Any]:
        """Steps, mismatches, and the reward's first and last three steps among those that learned (all finite)."""
        rewards = [s.reward for s in self.steps if s.learned]
        k = min(3, len(rewards))
        return {
            "steps": len(self.steps),
            "mismatch_free_steps": sum(1 for s in self.steps if s.mismatches == 0),
            "mismatches": sum(s.mismatches for s in self.steps),
            "tokens": sum(s.tokens for s in self.steps),
            "non_finite_steps": sum(1 for s in self.steps if not s.learned),
            "reward_first3": statistics.fmean(rewards[:k]) if rewards else math.nan,
            "reward_last3": statistics.fmean(rewards[-k:]) if rewards else math.nan,
            "median_step_seconds": self.median_seconds("step"),
        }
