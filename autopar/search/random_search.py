"""Random search: the baseline any search must beat at the same budget.

It samples `trials` plans knob by knob, each knob uniform among the choices valid after the
earlier ones (the walk Optuna takes, without the learning), and evaluates them in one
vectorised cost-model call.
"""

from __future__ import annotations

import numpy as np

from autopar.cost import PlanArrays, evaluate
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.search.sampling import best_distinct, check_space
from autopar.search.space import sample


class RandomPlanner(Planner):
    name = "random"

    def __init__(self, trials: int = 200, seed: int | None = 0):
        super().__init__()
        if trials < 1:
            raise AutoparError(f"--trials must be at least 1, got {trials}")
        self.trials, self.seed = trials, seed

    def propose(self, workload, k: int = 1) -> list[Plan]:
        check_space(workload)
        rng = np.random.default_rng(self.seed)
        plans = [sample(workload, lambda knob, choices: int(rng.integers(len(choices)))) for _ in range(self.trials)]
        result = evaluate(workload, PlanArrays.from_plans(plans, workload.profile))
        best, extra = best_distinct(workload, plans, result, k, "random search")
        self.evaluations = len(plans) + extra
        return best
