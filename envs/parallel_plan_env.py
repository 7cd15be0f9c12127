"""`autopar/ParallelPlan-v0`: one episode plans one workload, one step decides one knob.

Knobs come in the order of the registry's decisions (`autopar.knobs.decisions()`); a knob whose mask leaves a single choice
is applied without asking (a model without a tensor-parallel plan never decides tp, a plan
without data parallelism never decides ZeRO), except that an episode never ends at reset. The
reward comes at the last step from a reward backend (`autopar.envs.rewards`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autopar.envs.features import BOUND, observation, observation_size, workload_features
from autopar.envs.knobs import MAX_ACTIONS, PlanSpace
from autopar.envs.rewards import INVALID_REWARD, CostModelReward, RewardBackend
from autopar.envs.workloads import feasible, sample_training_spec
from autopar.errors import NoValidPlanError


class ParallelPlanEnv(gym.Env):
    """Plan a workload knob by knob.

    workloads: the pool `reset()` draws from (uniformly, with `self.np_random`); without one,
    each reset draws a new workload from the zoo's training mix (`sample_training_spec`), so
    `gym.make("autopar/ParallelPlan-v0")` works with defaults. A workload can also be given per
    episode with `reset(options={"workload": w})`. reward: a RewardBackend
    (default: the cost model against the exhaustive oracle).
    """

    metadata = {"render_modes": []}

    def __init__(self, workloads=None, reward: RewardBackend | None = None, coeffs=None):
        self.workloads = list(workloads or [])
        self.reward_backend = reward or CostModelReward(coeffs)
        self.coeffs = coeffs
        self.action_space = spaces.Discrete(MAX_ACTIONS)
        self.observation_space = spaces.Box(-BOUND, BOUND, shape=(observation_size(),), dtype=np.float32)
        self._spaces: dict[int, tuple] = {}  # id(workload) -> (workload, PlanSpace, features)
        self._workload = self._space = self._features = None
        self._prefix: tuple = ()

    # -- gymnasium API -----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        workload = (options or {}).get("workload")
        if workload is None:
            workload = (self.workloads[int(self.np_random.integers(len(self.workloads)))] if self.workloads
                        else self._training_draw())
        self._workload, self._space, self._features = self._context(workload)
        self._prefix = ()
        if not self._space.step(()).allowed.any():
            raise NoValidPlanError(f"no plan of the space fits {workload.describe()}")
        self._prefix = self._space.advance((), last=len(self._space.knobs) - 1)
        return self._get_obs(), self._get_info()

    def step(self, action):
        decided = self._prefix
        try:
            value = self._space.step(decided).value_at(int(action))
        except ValueError:
            return self._get_obs(), INVALID_REWARD, True, False, {**self._get_info(), "invalid_action": True}
        self._prefix = self._space.advance(self._prefix + (value,))
        if len(self._prefix) < len(self._space.knobs):
            return self._get_obs(), 0.0, False, False, self._get_info()
        plan = self._space.plan(self._prefix)
        reward = float(self.reward_backend(self._workload, plan))
        # a finished episode has no next decision: its observation is that of the last one
        return observation(self._space, decided, self._features), reward, True, False, {"knob": None, "plan": plan}

    def _training_draw(self):
        """A feasible workload of the zoo's training mix, drawn with the env's own generator."""

        while True:
            spec = sample_training_spec(self.np_random)
            if spec is not None and feasible(workload := spec.build()):
                return workload

    def action_masks(self) -> np.ndarray:
        """The actions allowed now (sb3-contrib's MaskablePPO reads this)."""
        if len(self._prefix) >= len(self._space.knobs):
            return np.ones(MAX_ACTIONS, dtype=bool)
        return self._space.step(self._prefix).mask()

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def plan_space(self) -> PlanSpace:
        return self._space

    def _context(self, workload):
        hit = self._spaces.get(id(workload))
        if hit is None:
            hit = self._spaces[id(workload)] = (workload, PlanSpace(workload, self.coeffs), workload_features(workload))
        return hit

    def _get_obs(self) -> np.ndarray:
        return observation(self._space, self._prefix, self._features)

    def _get_info(self) -> dict:
        return {"knob": self._space.names[len(self._prefix)] if len(self._prefix) < len(self._space.knobs) else None}
