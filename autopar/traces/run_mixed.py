"""One measured run of a mixed plan (issue 42), as a library call: check, launch, report.

`autopar run mixed.json --cluster A:N,B:M` calls `run_mixed`. Everything refused is refused in one
line before torchrun starts: the plan against the cluster and the model (`MixedPlan.validate`), what
the executor cannot run (`autopar.capability.mixed`, then the cuts and tensor-parallel styles each
rank would lay out: `preflight_mixed`), a launch of another number of ranks. The ranks run on gloo
here; each is labelled with its group (`autopar.executor.mixed_layout.RankLabel`). No trace record:
trace records hold homogeneous plans. Under --elastic each node names its group (--node-group; on NCCL
by default the group of its GPU model, unverified) and the workers re-plan for the mix that runs
(`autopar.executor.elastic`, `autopar.mixed.replan.MixReplanner`).
The NCCL path of a mixed plan (each node of its own GPU type) is unverified: no mixed machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.capability.mixed import check_mixed
from autopar.cluster.gpus import GPUS, match_gpu
from autopar.cluster.mixed import MixedCluster, load_any_cluster
from autopar.errors import AutoparError, ModelFileError
from autopar.executor.launch import LaunchResult, launch
from autopar.executor.mesh import resolve_backend
from autopar.executor.mixed_layout import check_world, rank_labels
from autopar.executor.mixed import preflight_mixed
from autopar.executor.options import RunOptions
from autopar.executor.support import target
from autopar.knobs import storage_dtype
from autopar.mixed.cost import estimate_mixed
from autopar.mixed.plan import MixedPlan
from autopar.mixed.workload import MixedWorkload
from autopar.modelfile import load_model_file
from autopar.profile import profile_model
from autopar.profile.isolated import DEFAULT_PROFILE_TIMEOUT
from autopar.traces.record import model_entry
from autopar.traces.run_plan import claim_job_folder

MIXED_REPLANNER = "autopar.mixed.replan:from_worker_args"  # an elastic mixed job's `ElasticSpec.replanner`


@dataclass(frozen=True)
class MixedRun:
    """How the run ended, the plan it ran, the cost model's figures for it on the named cluster, and a note
    when there are none (the model could not be profiled, or the cost model refused)."""

    launched: LaunchResult
    plan: MixedPlan
    predicted: dict | None = None  # the cost model's step and tokens/s on the named cluster (MixedEstimate.to_dict)
    note: str = ""


def check_options(options: RunOptions, cluster: str | None, trace) -> None:
    """What a mixed run does not take, refused before anything is read."""
    if trace:
        raise AutoparError("--trace records homogeneous plans only; run the mixed plan without --trace")
    if not cluster:
        raise AutoparError("a mixed plan needs its cluster: add --cluster PRESET:NODES,PRESET:NODES (the groups its "
                           "lanes name)")


def check_node_group(options: RunOptions, where: MixedCluster) -> RunOptions:
    """An elastic run's --node-group (on NCCL, by default the one group whose GPU model this node's first
    GPU matches: `this_gpus_group`) is a group of the cluster; its workers re-plan through the mixed
    re-planner."""
    if not options.elastic:
        return options
    group = options.elastic.node_group
    if group is None and options.backend == "nccl":
        group = this_gpus_group(where)
    if group is None:
        raise AutoparError("--elastic with a mixed plan needs --node-group GROUP on every node: the group of --cluster "
                           "its GPUs belong to (a re-plan counts the groups of the nodes running)")
    if group not in where.group_names:
        raise AutoparError(f"--node-group {group} is not a group of --cluster {where.name}; give one of "
                           f"{', '.join(where.group_names)}")
    return replace(options, elastic=replace(options.elastic, replanner=MIXED_REPLANNER, node_group=group))


def this_gpus_group(where: MixedCluster) -> str:
    """The group of `where` whose GPU model is this node's first CUDA GPU's (`match_gpu` on its name and
    memory); one line where none or several are. Unverified on a machine of two GPU types."""
    import torch  # torch: only this default needs the device

    props = torch.cuda.get_device_properties(0)
    key = match_gpu(props.name, props.total_memory)
    found = [g for g in where.group_names if key and where.group(g).gpu.name == GPUS[key].name]
    if len(found) != 1:
        which = f" ({', '.join(found)})" if found else ""
        raise AutoparError(f"this node's GPU ({props.name}) is the GPU of {len(found)} groups{which} of --cluster "
                           f"{where.name}; give --node-group GROUP")
    return found[0]


def run_mixed(plan_path, model, model_args: dict, options: RunOptions, *, cluster: str | None,
              profile_timeout: float | None = None, trace=None) -> MixedRun:
    """Check the mixed plan file, then run it on this node's ranks (one per GPU of the plan)."""
    check_options(options, cluster, trace)
    mixed = MixedPlan.load(plan_path)
    where = load_any_cluster(cluster)
    if not isinstance(where, MixedCluster):
        raise AutoparError(f"--cluster {cluster} is one group, but the plan is a mixed plan; give the groups its "
                           f"lanes name: --cluster PRESET:NODES,PRESET:NODES")
    if not options.elastic:  # an elastic job re-plans for the ranks that come
        check_world(mixed, options.world_size, f"--nnodes {options.nnodes} x --nproc-per-node {options.nproc_per_node}")
    options = replace(options, backend=resolve_backend(options.backend, options.nproc_per_node))
    options = check_node_group(options, where)
    check_mixed(mixed, target(options.backend))  # what the executor cannot run, before the profile's process
    model_file = load_model_file(model)
    precision = mixed.lanes[0].plan.precision
    timeout = DEFAULT_PROFILE_TIMEOUT if profile_timeout is None else profile_timeout
    note, predicted = "", None
    try:
        profile = profile_model(model, model_args, dtype=storage_dtype(precision), timeout=timeout)
    except ModelFileError:
        raise
    except AutoparError as e:
        profile, note = None, f"not checked against the cluster: the model could not be profiled: {e}"
    if profile is not None:
        workload = MixedWorkload(profile, where, mixed.global_batch, fp8=precision == "fp8")
        mixed.validate(workload)
        try:
            predicted = estimate_mixed(workload, mixed).to_dict()
        except AutoparError as e:
            note = f"no prediction: the cost model cannot estimate this plan on {where.name}: {e}"
    preflight_mixed(mixed, model_file, model_args, options.backend)
    claim_job_folder(options, model_entry(model_file, model_args, profile))
    launched = launch(plan_path, model, model_args, options)
    return MixedRun(launched, mixed, predicted, note)


def labels_text(mixed: MixedPlan) -> list[str]:
    """One line per rank: its group, lane, segment, stage and tp rank."""
    return [str(label) for label in rank_labels(mixed)]

