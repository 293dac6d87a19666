"""The on-policy RL loop: the trainer (FSDP2, fp32 masters, compiled, under the engine contract) and a live engine,
weights synced every step, the rollout's log-probs certified equal to the trainer's as bit patterns.

loop.py      OnPolicyConfig, run_onpolicy: the steps (sync, rollout, contract, recompute, train, certify, record)
grpo.py      the GRPO-style objective (importance ratio, clip), ratio min / max and the k3 KL
task.py      the toy task: a reward computed from token ids
weights.py   the bf16 rounding of the masters, gathered whole under checkpoint names, written for the engine
run_dir.py   DIR: the last complete step's checkpoint and rollout dump, metrics.json
report.py    the table, the summary line, the PNG plot
"""

from fx_precision.onpolicy.loop import OnPolicyConfig, OnPolicyRun, StepMetrics, run_onpolicy
from fx_precision.onpolicy.task import TargetTokens

__all__ = ["OnPolicyConfig", "OnPolicyRun", "StepMetrics", "TargetTokens", "run_onpolicy"]
