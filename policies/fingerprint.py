"""What a trained policy depends on, as digests recorded in the policy file.

`space`: the registry's decisions, slots and observation layout (`autopar.envs.features.space_signature`):
a policy trained under another space reads its actions differently and is refused. `cost`: the
oracle the policy learnt from, fingerprinted by its behaviour: the cost model's predictions
(iteration time, peak memory, fits; 4 significant digits) for 2,048 plans spread over the space of each of a fixed
set of probe workloads (`PROBES`, one per preset the training and held-out sets use), with the
space's field list and plan counts. An edit that changes no prediction (an import moved, a comment,
a refactor) leaves it as it was; a change of the model's numbers or of the space does not. When it
changes the policy still runs but may no longer match the oracle, so planners say so in one line and
the test suite fails until the shipped policy is retrained (`RETRAIN_COMMAND`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from autopar import cost
from autopar.envs.features import space_signature
from autopar.envs.workloads import WorkloadSpec
from autopar.search.space import enumerate_plans

RETRAIN_COMMAND = "autopar train cost --workloads 1024 --timesteps 100000 -o policies/default_policy.zip"
PROBES = (  # the runtime is the trainer's (torch); models, precisions and sizes spread over the pool's
    WorkloadSpec("gpt", (("size", "gpt2-medium"),), "dgx-a100-80g", nodes=2, global_batch=64),
    WorkloadSpec("llama", (("seq_len", 2048), ("size", "small")), "dgx-h100", global_batch=32),
    WorkloadSpec("gpt", (("size", "gpt3-1.3b"),), "dgx-v100", nodes=4, global_batch=128, precision="fp16"),
    WorkloadSpec("bert", (("size", "bert-large"),), "dgx-a100-40g", gpus_per_node=4, global_batch=64),
    WorkloadSpec("vit", (("size", "vit-b16"),), "pcie-4090x8", global_batch=64, precision="fp16"),
    WorkloadSpec("llama", (("size", "llama2-7b"),), "dgx-h200", nodes=2, global_batch=64),
    WorkloadSpec("gpt", (("size", "1.7b"),), "l40s-pcie", nodes=3, global_batch=48),
    WorkloadSpec("llama", (("seq_len", 4096), ("size", "llama3-8b")), "dgx-b200", nodes=2, global_batch=64),
    WorkloadSpec("gpt", (("size", "3.6b"),), "gb200-nvl72", gpus_per_node=16, global_batch=64),
    # fp8: torchao's recipes, their casts, compile and tensorwise TP's fp8 gathers (cost/precision.py), which
    # no probe above prices (a change of them left the fingerprint as it was on 2026-12-07)
    WorkloadSpec("llama", (("seq_len", 4096), ("size", "llama3-8b")), "dgx-h100", global_batch=64, precision="fp8"),
)
PLANS_PER_PROBE = 2048  # spread evenly over the space's order; a few milliseconds of evaluation each
OUTPUTS = ("iteration_time", "peak_memory", "fits")


def _rounded(values) -> list[str]:
    return [f"{float(v):.4g}" for v in values]


def cost_fingerprint() -> str:
    digest = hashlib.sha256()
    for spec in PROBES:
        workload = spec.build()
        space = enumerate_plans(workload)
        plans = space.take(np.unique(np.linspace(0, len(space) - 1, PLANS_PER_PROBE).astype(int)))
        result = cost.evaluate(workload, plans)
        digest.update(json.dumps([spec.to_dict(), len(space), cost.PlanArrays.names(),
                                  {k: _rounded(result[k]) for k in OUTPUTS}]).encode())
    return digest.hexdigest()[:16]


def fingerprint() -> dict[str, str]:
    return {"space": space_signature(), "cost": cost_fingerprint()}


@functools.cache
def _this_process() -> dict[str, str]:
    """The fingerprint once per process: neither the space nor the cost model changes while it runs, and
    a planner is built again for every re-plan of an elastic job (about a second each otherwise)."""
    return fingerprint()


def stale(meta: dict) -> list[str]:
    """The parts of the fingerprint that changed since the policy was trained."""
    recorded = meta.get("fingerprint") or {}
    return [part for part, value in _this_process().items() if recorded.get(part) != value]


def stale_note(meta: dict, path) -> str | None:
    """One line when the cost model changed since training (a changed space is refused at load)."""
    if "cost" not in stale(meta):
        return None
    return (f"note: {Path(path).name} was trained against an older cost model (its predictions on the "
            f"probe workloads changed since); its plans may trail the oracle until it is retrained: {RETRAIN_COMMAND}")
