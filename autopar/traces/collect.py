"""Collect traces: run a spread of plans of one model with the executor and append their records.

For calibration the plans should differ in what the cost model has to get right (degrees,
micro-batch size, recompute, ZeRO stage), and the set should include what the planner would pick,
so that "does the calibrated planner pick the measured best?" has an answer. `choose_plans`
takes the cost model's best plan for each process count, then a seeded random sample of plans
with distinct structure (dp, tp, pp, micro-batch, recompute mode, ZeRO stage) among those that fit
and that the backend can run. Each plan runs as `autopar run` runs it (the executor's
measured-reward backend: one worker process per rank), so a failing plan costs its own run
only; every run, failures included, is appended to the trace file.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.cluster import detect, load_cluster
from autopar.cluster.measured import is_cpu
from autopar.cost import PlanArrays, evaluate
from autopar.errors import AutoparError
from autopar.executor.options import RunOptions
from autopar.executor.support import refusal
from autopar.plan import RECOMPUTE_MODES
from autopar.profile import profile_model
from autopar.search.exhaustive import ExhaustivePlanner, distinct
from autopar.search.space import enumerate_plans
from autopar.traces.launchers import RunSpec
from autopar.workload import Workload

STRUCTURE = ("dp", "tp", "pp", "micro_batch_size", "recompute", "zero")  # what calibration must see vary


def choose_plans(workload, k: int, seed: int = 0, backend: str = "gloo") -> list:
    """Up to k plans of the workload: the cost model's best first, then distinct structures at
    random (seeded). Plans that do not fit, offload the optimizer, interleave, or reduce gradients
    in a dtype the backend lacks are left out; full recompute checkpoints every block."""

    space = enumerate_plans(workload)
    if len(space) == 0:
        raise AutoparError(f"no plan for global batch {workload.global_batch} on {workload.world_size} ranks")

    res = evaluate(workload, space)
    full = RECOMPUTE_MODES.index("full")
    all_blocks = space.recomputes_every_block()
    keep = (res["fits"] & ~space.offload_optimizer & (space.virtual_stages == 1)
            & ((space.recompute != full) | all_blocks)
            & (space.bucket_mb == 25.0))
    index = np.flatnonzero(keep)
    if len(index) == 0:
        raise AutoparError(f"no plan of {workload.profile.name} fits {workload.world_size} ranks of "
                           f"{workload.cluster.name}")

    def runs_here(i: int) -> bool:
        return refusal(space.plan(i), backend) is None

    best = ExhaustivePlanner().propose(workload, 1)[0]
    best_row = PlanArrays.from_plans([best], workload.profile)
    seen = {tuple(float(best_row.columns[f][0]) for f in STRUCTURE)}
    rows = distinct(space, np.random.default_rng(seed).permutation(index), k - 1, list(STRUCTURE), runs_here, seen)
    return [best] + [space.plan(i) for i in rows]


def backend_for(backend: str, nproc: int, cluster: str | None, launcher=None) -> str:
    """The backend the plans are chosen for and run on: 'auto' is NCCL when this machine has a GPU
    for every rank; a scheduler's nodes are not this machine (a login node may have no GPU), so
    there an explicit --backend stands and 'auto' is NCCL when --cluster names GPUs."""
    from autopar.executor.mesh import resolve_backend  # pulls torch: imported on first use

    if launcher is None or launcher.here:
        return resolve_backend(backend, nproc)
    if backend != "auto":
        return backend
    return "nccl" if cluster and not is_cpu(load_cluster(cluster)) else "gloo"


def collect(model, model_args: dict, global_batch: int, plans: int, nprocs=(2, 4), *, cluster=None,
            precision: str = "fp32", output, options=None, seed: int = 0, repeats: int = 1,
            progress=None, launcher=None, nodes: int = 1, dry_run: bool = False) -> list[dict]:
    """Run `plans` plans spread over the process counts, `repeats` times each, append every record
    to `output`, and return one summary per run (plan, outcome, measured and predicted step time).
    Repeats go round by round (every plan once, then again), so a slow spell of a shared machine
    touches one run of many plans rather than every run of one; calibration takes the median of a
    plan's runs. `options`: the RunOptions of every run (default RunOptions()); its process count
    per node is each of `nprocs` in turn, on `nodes` nodes. `launcher`: where the runs run
    (`autopar.traces.launchers`, default this machine); `dry_run`: submit nothing, and return each
    plan's job script (in "script") instead."""

    from autopar.traces.reward import MeasuredReward  # pulls torch: imported on first use

    say = progress or (lambda msg: None)
    nprocs = sorted(set(int(n) for n in nprocs))
    if plans < 1 or repeats < 1 or not nprocs or nprocs[0] < 1:
        raise AutoparError(f"need --plans >= 1, --repeats >= 1 and process counts >= 1, got {plans}, {repeats} "
                           f"and {nprocs}")
    options = options or RunOptions()
    backend = backend_for(options.backend, max(nprocs), cluster, launcher)
    profile = profile_model(model, model_args, dtype=precision)
    base = load_cluster(cluster) if cluster else (load_cluster("cpu") if backend == "gloo" else detect())
    share = [plans // len(nprocs) + (1 if i < plans % len(nprocs) else 0) for i in range(len(nprocs))]
    runs = []
    for n, k in zip(nprocs, share):
        if k == 0:
            continue
        workload = Workload(profile, base.with_nodes(nodes, n), global_batch)
        chosen = choose_plans(workload, k, seed, backend)
        run_options = replace(options, nproc_per_node=n, nnodes=nodes, backend=backend)
        if dry_run:
            spec = RunSpec(str(model), model_args, run_options, trace=output)
            runs += [{"ranks": n * nodes, "plan": plan.describe(), "script": launcher.script(plan, spec)}
                     for plan in chosen]
            continue
        reward = MeasuredReward(model, model_args, run_options, trace_path=output, launcher=launcher)
        for j, plan in [*enumerate(chosen, start=1)] * repeats:  # round by round
            say(f"{n * nodes} ranks, plan {j}/{len(chosen)}: {plan.describe()}")
            out = reward.run(plan)
            record = out["record"] or {}
            measured = (record.get("measured") or {}).get("median_step_s")
            predicted = (record.get("predicted") or {}).get("iteration_time_s")
            runs.append({"ranks": n * nodes, "plan": plan.describe(), "outcome": record.get("outcome", "refused"),
                         "measured_s": measured, "predicted_s": predicted, "error": record.get("error")})
    return runs
