"""The measured reward backend: a plan's reward from a real run instead of the cost model.

Each plan runs through `autopar run` in a child process (so a crashing, hanging or
out-of-memory job never takes the caller down, and torchrun's signal handlers stay out of
it); the reward is minus the measured median step time, and a fixed clear negative when the
run ends in oom / timeout / error. Results are cached on disk by workload and plan, since a
measurement costs seconds to minutes and the RL environment proposes the same plans again.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.atomic import write_text_atomic
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.traces import append_record, read_records

FAILURE_REWARD = -1000.0  # far below any real -step_time: an infeasible plan
RUN_COMMAND = (sys.executable, "-m", "autopar", "run")


class MeasuredReward:
    """`reward(plan) -> {"reward": float, "record": trace dict or None, "cached": bool}`."""

    def __init__(self, model_path, model_args: dict | None = None, *, steps: int = 5, warmup: int = 2,
                 nproc: int = 1, cache_path=None, timeout_s: float = 600.0, backend: str = "auto",
                 failure_reward: float = FAILURE_REWARD, trace_path=None, cluster: str | None = None):
        self.model_path = str(model_path)
        self.model_args = dict(model_args or {})
        self.steps, self.warmup, self.nproc = steps, warmup, nproc
        self.timeout_s, self.backend = timeout_s, backend
        self.failure_reward = failure_reward
        self.trace_path = trace_path  # every measurement is also appended here, when given
        self.cluster = cluster  # preset or JSON the records and predictions name (default: detected)
        self.cache_path = Path(cache_path) if cache_path else None
        self.model_digest = load_model_file(self.model_path).digest
        self._cache = json.loads(self.cache_path.read_text()) if self.cache_path and self.cache_path.exists() else {}

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
        if record is not None:  # a launcher that died leaves nothing worth remembering
            self._cache[key] = entry
            self._save()
        return {**entry, "cached": False}

    def _measure(self, plan: Plan) -> dict | None:
        """Run the plan; its trace record, or None when the launcher itself died."""
        with tempfile.TemporaryDirectory(prefix="autopar-reward-") as tmp:
            plan_path, trace = Path(tmp) / "plan.json", Path(tmp) / "trace.jsonl"
            plan.save(plan_path)
            argv = [*RUN_COMMAND, str(plan_path), self.model_path,
                    "--steps", str(self.steps), "--warmup", str(self.warmup), "--nproc-per-node", str(self.nproc),
                    "--backend", self.backend, "--timeout", str(self.timeout_s), "--trace", str(trace)]
            argv += [f"--model-arg={k}={v}" for k, v in self.model_args.items()]
            if self.cluster:
                argv += ["--cluster", self.cluster]
            try:
                subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=self.timeout_s + 120, check=False)
            except subprocess.TimeoutExpired:
                return None
            records = read_records(trace)[0] if trace.exists() else []
        if not records:
            return None
        if self.trace_path:
            append_record(self.trace_path, records[-1])
        return records[-1].to_dict()

    def _save(self) -> None:
        """Write the cache atomically: a crash never leaves half a file."""
        if self.cache_path is None:
            return
        write_text_atomic(self.cache_path, json.dumps(self._cache))
