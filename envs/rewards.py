"""Reward backends: how good a finished plan is for its workload.

A backend is any callable `(workload, plan) -> float`; the environment calls it once, at the
end of an episode. `CostModelReward` (the default) is scale-free: the exhaustive oracle's
iteration time over the plan's, in (0, 1], so a 1T-parameter workload weighs as much as a small
one; a plan that does not fit in memory gets `OOM_REWARD`. A backend for measured runs
(`MeasuredReward`, autopar/traces/reward.py: a real run) plugs in the same way and should return `OOM_REWARD` for a
run that ran out of memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Protocol

from autopar import axes, capability, knobs
from autopar.atomic import write_text_atomic
from autopar.cost import estimate
from autopar.cost import model as cost_model
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.profile.cache import cache_dir
from autopar.search import exhaustive, space, stages

OOM_REWARD = -1.0
INVALID_REWARD = -1.0  # a masked action taken anyway (only by policies that ignore the masks)
# the oracle depends on their code: every module of autopar/cost/, the space's declarations, the
# searches, and this module (which says how the oracle searches)
_CODE = (space, exhaustive, stages, knobs, axes, capability)


class RewardBackend(Protocol):
    def __call__(self, workload, plan: Plan) -> float: ...


@functools.cache
def _code_digest() -> str:
    files = sorted(Path(cost_model.__file__).parent.glob("*.py")) + [Path(m.__file__) for m in _CODE] + [Path(__file__)]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def workload_key(workload) -> str:
    """What the oracle's answer depends on: the profile, the cluster (with its coefficients), the
    workload's settings (an fp8 workload shares its bf16 profile) and the code of the cost model and
    the space."""
    settings = [workload.global_batch, workload.optimizer, workload.memory_headroom, workload.runtime,
                list(workload.switches), workload.expert_imbalance, workload.fp8]
    key = [workload.profile.digest, workload.cluster.to_dict(), settings, _code_digest()]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _oracle_dir() -> Path:
    return cache_dir() / "oracle"


class OracleCache:
    """The best iteration time of each workload under the cost model, kept in memory and on disk
    (one small JSON per workload under the autopar cache directory)."""

    def __init__(self, coeffs=None):
        self.coeffs = coeffs
        self._best: dict[int, tuple] = {}  # id(workload) -> (workload, time, plan): workloads are not hashable

    def time(self, workload) -> float:
        return self.best(workload)[0]

    def best(self, workload) -> tuple[float, Plan]:
        """The oracle's iteration time and plan."""
        hit = self._best.get(id(workload))
        if hit is None:
            key = workload_key(workload)
            hit = self._best[id(workload)] = (workload, *(self._load(key) or self._compute(workload, key)))
        return hit[1], hit[2]

    def _load(self, key: str) -> tuple[float, Plan] | None:
        if self.coeffs is not None:
            return None  # custom coefficients are not part of the key
        try:
            data = json.loads((_oracle_dir() / f"{key}.json").read_text())
            return float(data["iteration_time_s"]), Plan.from_dict(data["plan"])
        except (OSError, ValueError, KeyError, TypeError, AutoparError):
            return None

    def _compute(self, workload, key: str) -> tuple[float, Plan]:
        # the policy decides the uniform knobs; the per-stage solver finishes its plans (policies/planner.py)
        planner = exhaustive.ExhaustivePlanner(self.coeffs, per_stage=False)
        pa, res = planner.ranked(workload, 1)
        time, plan = float(res["iteration_time"][0]), pa.plan(0)
        if self.coeffs is None:
            _write_json(_oracle_dir() / f"{key}.json", {"iteration_time_s": time, "plan": plan.to_dict(),
                                                         "evaluations": planner.evaluations})
        return time, plan


def _write_json(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data))


class CostModelReward:
    """Oracle time / plan time under the cost model; OOM_REWARD when the plan does not fit."""

    def __init__(self, coeffs=None, oracle: OracleCache | None = None):
        self.coeffs = coeffs
        self.oracle = oracle or OracleCache(coeffs)

    def __call__(self, workload, plan: Plan) -> float:
        est = estimate(workload, plan, self.coeffs)
        if not est.fits:
            return OOM_REWARD
        return min(1.0, self.oracle.time(workload) / est.iteration_time_s)
