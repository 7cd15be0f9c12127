"""What runs, declared once: one capability rule per knob and axis.

Whether a plan can run depends on what runs it (the runtime: autopar's torch executor, which
`autopar run` always uses, or Megatron-Core), on the model's layout (`Layout`: facts the profiler
or the executor found) and on the hardware (the cluster, or the executor's backend and device).
Each knob or axis with such a rule declares it once (`declarations.py`), and everything asks it and
nothing else: the plan space's choices and the axes' degree rules (so every planner, the RL
masks and the Why table's "not considered" rows follow), `Plan.validate` (estimate, memory,
explain, search and `autopar run`'s check before launching) and the executor
(`autopar.executor.support`: `apply`'s check and `autopar run`'s pre-flight on the model it builds).
Standard library only: the plan contract imports it.
"""

from __future__ import annotations

from autopar.capability.core import (Device, Layout, Rule, Target, allowed, check, declare_rule, refusal,
                                     refusals, rules, undeclare_rule)
from autopar.capability.declarations import (BLOCK_SCALED, CP_MIN_TOKENS, FP8_CAPABILITY, FP8_RECIPES, check_plan,
                                      comm_dtype_problem, compile_problem, context_parallel_offered, excluded,
                                      fp8_problem, sequence_parallel_options, ZERO_BUBBLE)

__all__ = ["BLOCK_SCALED", "CP_MIN_TOKENS", "FP8_CAPABILITY", "FP8_RECIPES", "Device", "Layout", "Rule", "Target",
           "allowed", "check", "check_plan", "comm_dtype_problem", "compile_problem", "context_parallel_offered",
           "declare_rule", "excluded", "fp8_problem", "refusal", "refusals", "rules", "sequence_parallel_options",
           "undeclare_rule", "ZERO_BUBBLE"]
