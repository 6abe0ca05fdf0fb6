"""Activation checkpointing: plan what to recompute under a memory budget, and apply the plan.

`plan_checkpointing(model, *inputs, budget=...)` returns a `Plan` (planner.py); `UnitPolicy` is one
module's mode (policy.py); estimate.py reads what checkpointing a module would change off a trace.
Tracing a checkpointed step itself needs nothing from here: tapescope traces torch.utils.checkpoint
as it runs (capture/engine.py, capture/hooks.py); `profile(..., checkpointing=plan)` applies a plan
to the traced copy of the model.
"""

from .planner import ParetoPoint, Plan, Refusal, plan_checkpointing, plan_workload
from .policy import FULL, SELECTIVE, UnitPolicy, apply_policies, policy_code

__all__ = ["plan_checkpointing", "plan_workload", "Plan", "ParetoPoint", "Refusal", "UnitPolicy",
           "FULL", "SELECTIVE", "apply_policies", "policy_code"]
