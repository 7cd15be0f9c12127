"""The measured reward backend: a plan's reward from a real run instead of the cost model.

Each plan runs as `autopar run` runs it, through the executor's library call
(`autopar.traces.run_plan.run_plan`: torchrun's agent in this process, one worker process per
rank, so a crashing, hanging or out-of-memory rank ends as the record's outcome and never takes
the caller down); the reward is minus the measured median step time, and a fixed clear negative
when the run ends in oom / timeout / rank_failed, or when the plan is refused before it starts
(PlanError: nothing ran, nothing is cached). Results are cached on disk by workload and plan,
since a measurement costs seconds to minutes and the RL environment proposes the same plans
again. The job's deadline (RunOptions.timeout_s) is a SIGALRM timer: call from the main thread.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from autopar.atomic import write_text_atomic
from autopar.errors import AutoparError
from autopar.executor.options import RunOptions
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.traces.measured_cache import read_cache
from autopar.traces.launchers import Launcher, LocalLauncher, RunSpec

FAILURE_REWARD = -1000.0  # far below any real -step_time: an infeasible plan


class MeasuredReward:
    """`reward(plan) -> {"reward": float, "record": trace dict or None, "cached": bool}`."""

    def __init__(self, model_path, model_args: dict | None = None, options: RunOptions | None = None, *,
                 cache_path=None, failure_reward: float = FAILURE_REWARD, trace_path=None,
                 cluster: str | None = None, launcher: Launcher | None = None):
        self.model_path = str(model_path)
        self.model_args = dict(model_args or {})
        self.options = options or RunOptions()  # every plan runs on options.nnodes x options.nproc_per_node ranks
        self.launcher = launcher or LocalLauncher()  # where the plans run (autopar.traces.launchers)
        if self.options.nnodes != 1 and isinstance(self.launcher, LocalLauncher):
            raise AutoparError(f"the local launcher runs plans on one node, got --nnodes {self.options.nnodes}; "
                               f"use --launcher slurm or ray")
        self.nproc = self.options.world_size
        self.failure_reward = failure_reward
        self.trace_path = trace_path  # every measurement is also appended here, when given
        self.cluster = cluster  # preset or JSON the records and predictions name (default: detected)
        self.cache_path = Path(cache_path) if cache_path else None
        self.model_digest = load_model_file(self.model_path).digest
        self._cache = read_cache(self.cache_path) if self.cache_path else {}

    def key(self, plan: Plan) -> str:
        """The cache key: model file, model arguments, plan and world size."""
        blob = json.dumps({"model": self.model_digest, "args": self.model_args, "plan": plan.to_dict(),
                           "world": self.nproc}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def __call__(self, plan: Plan) -> dict:
        key = self.key(plan)  # a plan for another world size is never cached: `run` refuses it
        if key in self._cache:
            return {**self._cache[key], "cached": True}
        return self.run(plan)

    def run(self, plan: Plan) -> dict:
        """Measure the plan now, even when the cache knows it (a repeated run), and cache the result."""
        plan.dims.check_world(self.nproc, f"this reward backend runs {self.nproc}", "use a plan for "
                              f"{self.nproc} ranks", needs="the plan needs ")
        key = self.key(plan)
        record = self._measure(plan)
        ok = record is not None and record["outcome"] == "ok"
        entry = {"reward": -record["measured"]["median_step_s"] if ok else self.failure_reward, "record": record}
        if record is not None:  # a plan refused before it ran is not remembered
            self._cache[key] = entry
            self._save()
        return {**entry, "cached": False}

    def _measure(self, plan: Plan) -> dict | None:
        """Run the plan through the launcher; its trace record, or None when the plan was refused
        before it started."""
        spec = RunSpec(self.model_path, self.model_args, self.options, self.cluster, self.trace_path)
        return self.launcher.measure(plan, spec)

    def _save(self) -> None:
        """Write the cache atomically: a crash never leaves half a file."""
        if self.cache_path is None:
            return
        write_text_atomic(self.cache_path, json.dumps(self._cache))
