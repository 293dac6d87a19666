"""The on-policy RL loop: the trainer (FSDP2, fp32 masters, compiled, under the engine contract) and a live engine,
weights synced every step, the rollout's log-probs certified equal to the trainer's as bit patterns.

config.py    OnPolicyConfig: one run in sections (Sampling, Training, EngineLaunch), checked field by field
loop.py      run_onpolicy: preflight, DIR, the ranks, STEPS in order (gather, sync, rollout, contract, broadcast, build,
             recompute, train, certify, record, decide)
engine_side.py  rank 0's engine: weights sync, rollout, the step's contract, the step's record in DIR
batches.py   the fixed-shape micro-batches and their log-probs in the engine's form
metrics.py   certify (bit patterns), StepMetrics, OnPolicyRun, the standard metric names
grpo.py      the GRPO-style objective (importance ratio, clip), ratio min / max and the k3 KL
task.py      the toy task: a reward computed from token ids
weights.py   the bf16 rounding of the masters, gathered whole under checkpoint names
run_dir.py   DIR: the last complete step's checkpoint and rollout dump, metrics.json
report.py    the table, the summary line, the PNG plot
"""

from fx_precision.onpolicy.config import EngineLaunch, OnPolicyConfig, Sampling, Training
from fx_precision.onpolicy.loop import run_onpolicy
from fx_precision.onpolicy.metrics import OnPolicyRun, StepMetrics
from fx_precision.onpolicy.task import TargetTokens

__all__ = ["EngineLaunch", "OnPolicyConfig", "OnPolicyRun", "Sampling", "StepMetrics", "TargetTokens", "Training", "run_onpolicy"]
