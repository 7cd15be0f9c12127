"""The Gymnasium environment of autopar: plan a workload knob by knob (docs/plan-space.md).

Importing this package registers `autopar/ParallelPlan-v0`."""

from gymnasium.envs.registration import register, registry

ENV_ID = "autopar/ParallelPlan-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="autopar.envs.parallel_plan_env:ParallelPlanEnv")

__all__ = ["ENV_ID"]
