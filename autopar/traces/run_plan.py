"""One measured run of a plan, as a library call: check, predict, launch, record.

`autopar run` and the measured reward (`autopar.traces.reward`) both call `run_plan`, in their
own process: this process runs torchrun's agent (`autopar.executor.launch.launch`), the ranks run
in worker processes, so a rank that crashes, hangs or runs out of memory ends as an outcome of
the record (oom / timeout / rank_failed), never as an exception here. What is refused before
anything starts (a plan for another world size, one the executor cannot run on this backend or
that does not fit the model) raises PlanError; a model file that cannot be built, ModelFileError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.atomic import write_text_atomic
from autopar.cluster import detect, load_cluster
from autopar.cluster.measured import is_cpu
from autopar.cost import estimate
from autopar.cost.regime import regime_note
from autopar.errors import AutoparError, ModelFileError
from autopar.executor.launch import LaunchResult, check_world_size, launch
from autopar.executor.mesh import resolve_backend
from autopar.executor.options import RunOptions
from autopar.executor.preflight import preflight
from autopar.executor.support import check_supported
from autopar.modelfile import load_model_file
from autopar.knobs import storage_dtype
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.profile.isolated import DEFAULT_PROFILE_TIMEOUT
from autopar.traces.record import TraceRecord, append_record, model_entry, run_record
from autopar.workload import Workload


@dataclass(frozen=True)
class PlanRun:
    """How a run ended; `record` is its trace record (None on nodes other than 0, where rank 0's
    measurement is not); `note` says why there is no prediction, when there is none, or that it is
    rough (a CPU cluster not yet measured by `autopar profile-cluster`)."""

    launched: LaunchResult
    record: TraceRecord | None
    note: str = ""


def prepare(plan: Plan, options: RunOptions) -> RunOptions:
    """Refuse what cannot start, and choose the backend once for every worker (NCCL only with a GPU
    for every local rank)."""
    check_world_size(plan, options.at_world(plan))
    options = replace(options, backend=resolve_backend(options.backend, options.nproc_per_node))
    check_supported(plan, options.backend)
    return options


def resolve_cluster(cluster: str | None, options: RunOptions):
    """The cluster records and predictions name: a preset or cluster JSON, else this machine's."""
    if cluster:
        return load_cluster(cluster, nodes=options.nnodes, gpus_per_node=options.nproc_per_node)
    return detect().with_nodes(options.nnodes, options.nproc_per_node)


def prediction(model, model_args: dict, plan: Plan, cluster, timeout: float) -> tuple[dict | None, object, str]:
    """The cost model's figures for this plan on this cluster, the model's profile, and a note when
    there is no prediction (the profiler or the cost model refused the model, the plan's precision
    or the cluster with an AutoparError, which the note quotes) or when it is rough (a CPU cluster
    `autopar profile-cluster` has not measured). A plan the model's profile rejects
    (PlanError: what the executor cannot run for it) is refused before launching; otherwise the
    prediction is an aside and the run goes ahead; any other exception is a bug and propagates.
    The profile runs the model file in a child process first (within `timeout`), so a model that
    exits or hangs at import is reported before the launcher imports it."""
    try:
        profile = profile_model(model, model_args, dtype=storage_dtype(plan.precision), timeout=timeout)
    except ModelFileError:
        raise  # a model that cannot be imported or built cannot run either
    except AutoparError as e:
        return None, None, f"no prediction: the model could not be profiled: {e}"
    workload = Workload(profile=profile, cluster=cluster, global_batch=plan.global_batch, fp8=plan.precision == "fp8")
    plan.validate(workload)
    try:
        est = estimate(workload, plan)
    except AutoparError as e:
        return None, profile, f"no prediction: the cost model cannot estimate this plan on {cluster.name}: {e}"
    # a CPU cluster this machine has not measured predicts 50-70x off: the run says so under its table
    rough = regime_note(workload, plan, est) if is_cpu(cluster) else ""
    return {"iteration_time_s": est.iteration_time_s, "peak_memory_gb": est.peak_memory_bytes / 1e9}, profile, rough


def claim_job_folder(options: RunOptions, model: dict) -> None:
    """A job folder belongs to one model: resuming another model's checkpoints would fail on
    every rank, so refuse it now, in one line. The first run of a folder writes `job.json`."""
    if not options.elastic:
        return
    path = Path(options.elastic.checkpoint_dir) / "job.json"
    mine = {"model": model["name"], "digest": model["digest"], "args": model["args"]}
    try:
        theirs = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        write_text_atomic(path, json.dumps(mine))
        return
    except (OSError, ValueError) as e:
        raise AutoparError(f"cannot read {path}: {e}; give a fresh --checkpoint-dir") from None
    if not isinstance(theirs, dict) or theirs.get("digest") != mine["digest"]:
        raise AutoparError(f"--checkpoint-dir {path.parent} holds a job of another model or model arguments "
                           f"({theirs.get('model') if isinstance(theirs, dict) else '?'}); give a fresh folder")


def final_plan(result: dict | None, plan: Plan) -> Plan:
    """The plan an elastic job ended under (rank 0's result), else the one it started with."""
    final = (result or {}).get("measured", {}).get("plan")
    return Plan.from_dict(final) if final else plan


def run_plan(plan_path, model, model_args: dict, options: RunOptions, *, cluster: str | None = None,
             profile_timeout: float | None = None, trace=None) -> PlanRun:
    """Run the plan file on this node with these options, and build (and append to `trace`, on
    node 0) its trace record with the cost model's prediction beside the measurement."""

    plan = Plan.load(plan_path)
    options = prepare(plan, options)
    timeout = DEFAULT_PROFILE_TIMEOUT if profile_timeout is None else profile_timeout
    where = resolve_cluster(cluster, options.at_world(plan))
    predicted, profile, note = prediction(model, model_args, plan, where, timeout)
    model_file = load_model_file(model)
    preflight(plan, model_file, model_args)  # what apply() would refuse on every rank, refused now
    entry = model_entry(model_file, model_args, profile)
    claim_job_folder(options, entry)
    launched = launch(plan_path, model, model_args, options)
    if options.elastic and launched.result:  # recorded and predicted: the plan and world the job ended under
        plan = final_plan(launched.result, plan)
        where = resolve_cluster(cluster, options.at_world(plan))
        predicted, profile, note = prediction(model, model_args, plan, where, timeout)
    if options.node_rank != 0:  # rank 0, its measurement and the trace live on node 0
        return PlanRun(launched, None, note)
    record = run_record(plan, options.at_world(plan), where, entry, predicted, launched)
    if trace:
        append_record(trace, record)
    return PlanRun(launched, record, note)


def unran_record(plan: Plan, model, model_args: dict, options: RunOptions, outcome: str, error: str, *,
                 cluster: str | None = None, job: dict | None = None, trace=None) -> TraceRecord:
    """The record of a run that ended outside `run_plan` (a scheduler's job preempted for good, or
    lost with its node), built where the job was submitted, and appended to `trace`."""
    options = prepare(plan, options)
    where = resolve_cluster(cluster, options)
    predicted, profile, _ = prediction(model, model_args, plan, where, DEFAULT_PROFILE_TIMEOUT)
    entry = model_entry(load_model_file(model), model_args, profile)
    record = run_record(plan, options, where, entry, predicted, LaunchResult(outcome, error), job)
    if trace:
        append_record(trace, record)
    return record
