"""The GRPO-style objective of the on-policy loop and what it measures per token.

    group_advantages(rewards, group)      A_i = (r_i - mean of its group) / (std of its group + 1e-6); a group of
                                          equal rewards gives 0 (nothing to learn from it)
    grpo_token_loss(train, rollout, A)    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) per sampled token,
                                          ratio = exp(train - rollout): the importance ratio of the trainer's
                                          log-prob to the one the tokens were sampled with
    ratio_stats(train, rollout)           ratio min / max and the k3 estimate of KL(rollout || train):
                                          (ratio - 1) - log(ratio), per token, averaged

Under the engine contract ``train`` and ``rollout`` are the same bits, so every ratio is exactly 1 and k3 is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CLIP = 0.2


def group_advantages(rewards: Sequence[float], group: int) -> torch.Tensor:
    """[N] advantages of N = P x G rewards, in groups of ``group`` consecutive samples (one prompt's)."""
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True) if group > 1 else torch.zeros_like(r)
    return (centred / (std + 1e-6)).view(-1).float()


def grpo_token_loss(train: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor, clip: float = CLIP) -> torch.Tensor:
    """Per-token loss (module docstring); ``train`` carries the gradient, ``rollout`` and ``advantages`` do not."""
    ratio = torch.exp(train - rollout)
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)


def ratio_stats(train: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    """Ratio min / mean / max, and the mean k1 and k3 estimates of KL(rollout || train), over the given tokens (module
    docstring; k1: the mean of log p_rollout - log p_train, verl's ``rollout_corr/kl``)."""
    if train.numel() == 0:
        return {name: float("nan") for name in ("ratio_min", "ratio_mean", "ratio_max", "k1_kl", "k3_kl")}
    log_ratio = train.double() - rollout.double()
    ratio = log_ratio.exp()
    return {
        "ratio_min": float(ratio.min()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "k1_kl": float(-log_ratio.mean()) + 0.0,
        "k3_kl": float(((ratio - 1) - log_ratio).mean()),
    }  # fmt: skip (+ 0.0: no -0)
