"""`autopar run`: train a plan for a few steps through torchrun, measure it, record a trace.

Prints the median step time, throughput, peak memory per rank and the loss curve beside the
cost model's prediction for the same plan, and appends one trace record (`--trace`). A plan
for another world size is refused before anything starts. The exit status is 0 only when
the run finished; the trace records oom / timeout / error outcomes too.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

from autopar.cli.common import add_profile_timeout_flag, parse_model_args
from autopar.cli.elastic import add_elastic_flags, at_world, claim_job_folder, elastic_spec, final_plan, show_replans
from autopar.executor.launch import DEFAULT_TIMEOUT_S


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a plan for a few steps, measure it and record a trace",
                       description="Launch PLAN on MODEL with torchrun, train on the model's example batch, "
                                   "and print measured step time, throughput, peak memory and losses beside "
                                   "the cost model's prediction.")
    p.add_argument("plan", metavar="plan.json", help="a plan file, as `autopar search -o` writes")
    p.add_argument("model", metavar="MODEL", help="path to a model.py, or a zoo model name (gpt, llama, ...)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for build_model/example_batch, e.g. size=tiny (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="ranks on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (multi-node)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (multi-node)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: NCCL when this node has a GPU for every rank, else gloo")
    p.add_argument("--trace", metavar="traces.jsonl", help="append the run's trace record here")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"end the job after S seconds, outcome 'timeout'; also the collectives' timeout "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--cluster", metavar="PRESET|FILE.json",
                   help="the cluster to record and predict for (default: detected from this machine)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch seed (default 0)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--check-parity", action="store_true",
                   help="also train the model in one process and report the largest relative loss difference, "
                        "with what explains a mismatch (dropout, BatchNorm, low precision)")
    p.add_argument("--no-dropout", action="store_true",
                   help="turn every dropout of the model off (for --check-parity: dropout masks differ by rank)")
    add_profile_timeout_flag(p)
    add_elastic_flags(p)
    p.set_defaults(func=run)


def _spec(args):
    from autopar.errors import AutoparError
    from autopar.executor.launch import LaunchSpec

    for flag in ("steps", "nproc_per_node", "nnodes"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0 or not 0 <= args.node_rank < args.nnodes:
        raise AutoparError(f"need --warmup >= 0 and 0 <= --node-rank < --nnodes, got {args.warmup}, "
                           f"{args.node_rank}, {args.nnodes}")
    if not 0 < args.timeout < math.inf:
        raise AutoparError(f"--timeout must be a positive finite number of seconds, got {args.timeout}")
    if not 1 <= args.master_port <= 65535:
        raise AutoparError(f"--master-port must be a TCP port in [1, 65535], got {args.master_port}")
    if not 0 < args.lr < math.inf:
        raise AutoparError(f"--lr must be a positive finite number, got {args.lr}")
    return LaunchSpec(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                      master_addr=args.master_addr, master_port=args.master_port, backend=args.backend,
                      timeout_s=args.timeout, steps=args.steps, warmup=args.warmup, seed=args.seed,
                      optimizer=args.optimizer, lr=args.lr, check_parity=args.check_parity,
                      no_dropout=args.no_dropout, elastic=elastic_spec(args))


def _cluster(args, spec):
    from autopar.cluster import detect, load_cluster

    if args.cluster:
        return load_cluster(args.cluster, nodes=spec.nnodes, gpus_per_node=spec.nproc_per_node)
    return detect().with_nodes(spec.nnodes, spec.nproc_per_node)


def _prediction(model, model_args: dict, plan, cluster, timeout: float) -> tuple[dict | None, object, str]:
    """The cost model's figures for this plan on this cluster, the model profile's dims, and a
    note when there is no prediction (the profiler or the cost model refused the model, the plan's
    precision or the cluster with an AutoparError, which the note quotes). A plan the model's
    profile rejects (PlanError: what the executor cannot run for it) is refused before launching;
    otherwise the prediction is an aside and the run goes ahead; any other exception is a bug and
    propagates. The profile
    runs the model file in a child process first (within `timeout`), so a model that exits or hangs
    at import is reported before the launcher imports it."""
    from autopar.cost import estimate
    from autopar.errors import AutoparError, ModelFileError
    from autopar.profile import profile_model
    from autopar.workload import Workload

    try:
        profile = profile_model(model, model_args, dtype=plan.precision, timeout=timeout)
    except ModelFileError:
        raise  # a model that cannot be imported or built cannot run either
    except AutoparError as e:
        return None, None, f"no prediction: the model could not be profiled: {e}"
    workload = Workload(profile=profile, cluster=cluster, global_batch=plan.global_batch)
    plan.validate(workload)
    try:
        est = estimate(workload, plan)
    except AutoparError as e:
        return None, profile, f"no prediction: the cost model cannot estimate this plan on {cluster.name}: {e}"
    return {"iteration_time_s": est.iteration_time_s, "peak_memory_gb": est.peak_memory_bytes / 1e9}, profile, ""


def _model_info(model_file, model_args: dict, profile) -> dict:
    """The record's model, with its profile: calibration reads the profile and runs no code."""
    from autopar.traces.vtrain import model_digest

    digest = model_digest(model_file.path, model_args)
    params = sum(p.numel() for p in model_file.build(**model_args).parameters())  # meta: free
    return {"name": model_file.name, "path": str(model_file.path), "digest": digest, "args": model_args,
            "dims": dict(profile.dims) if profile else {}, "params": params,
            "profile": profile.to_dict() if profile else None}


def _record(plan, spec, cluster, model, predicted, launched):
    from autopar.traces import TraceRecord, current_versions

    result = launched.result or {}
    backend = result.get("backend", spec.backend)
    gpu = result.get("device", cluster.gpu.name)
    return TraceRecord(
        cluster={"name": cluster.name, "nodes": spec.nnodes, "gpus_per_node": spec.nproc_per_node, "gpu": gpu,
                 "backend": backend},
        model=model, workload={"global_batch": plan.global_batch,
                               "seq_len": result.get("seq_len", model["dims"].get("seq_len"))},
        plan=plan.to_dict(), outcome=launched.outcome, measured=result.get("measured", {}),
        predicted=predicted, error=launched.error, versions=current_versions(backend))


def _show(console, record, launched, note: str) -> None:
    from rich.table import Table

    m, pred = record.measured, record.predicted
    title = f"autopar run: {launched.outcome} in {launched.wall_s:.1f} s"
    if m:
        table = Table(title=title, title_justify="left")
        table.add_column("")
        table.add_column("measured", justify="right")
        table.add_column("predicted", justify="right")
        tokens = record.workload["global_batch"] * record.workload["seq_len"]
        unit = "tokens/s" if record.workload["seq_len"] > 1 else "samples/s"
        table.add_row("median step", f"{m['median_step_s'] * 1e3:,.1f} ms",
                      f"{pred['iteration_time_s'] * 1e3:,.1f} ms" if pred else "-")
        table.add_row(f"throughput ({unit})", f"{m['tokens_per_s']:,.0f}",
                      f"{tokens / pred['iteration_time_s']:,.0f}" if pred else "-")
        table.add_row("peak memory (max rank)", f"{max(m['peak_memory_bytes']) / 1e9:.3f} GB",
                      f"{pred['peak_memory_gb']:.3f} GB" if pred else "-")
        table.add_row("peak memory per rank", " ".join(f"{b / 1e9:.2f}" for b in m["peak_memory_bytes"]) + " GB", "")
        table.add_row("loss per step", " ".join(f"{x:.4f}" for x in m["losses"]), "")
        if "parity_max_rel_diff" in m:
            table.add_row(f"parity vs 1 process ({m.get('parity_reference', 'cpu fp32')})",
                          m.get("parity_verdict", f"max rel. diff {m['parity_max_rel_diff']:.1e}"), "")
        console.print(table)
    else:
        console.print(title, style="bold")
    if note:
        console.print(note, style="yellow", markup=False)
    if launched.error:
        console.print(launched.error, style="red", markup=False, highlight=False)


def run(args) -> int:
    from autopar.executor.launch import check_world_size, launch
    from autopar.plan import Plan

    plan = Plan.load(args.plan)
    spec = _spec(args)
    check_world_size(plan, at_world(spec, plan))  # the flags and the plan, before torch is imported (seconds)
    from rich.console import Console

    from autopar.executor.mesh import resolve_backend
    from autopar.executor.preflight import preflight
    from autopar.executor.support import check_supported
    from autopar.modelfile import load_model_file
    from autopar.traces import append_record

    # the backend the workers will use, chosen once here: NCCL only with a GPU for every local rank
    spec = replace(spec, backend=resolve_backend(spec.backend, spec.nproc_per_node))
    check_supported(plan, spec.backend)
    model_args = parse_model_args(args.model_arg, None)
    console = Console()
    cluster = _cluster(args, at_world(spec, plan))
    predicted, profile, note = _prediction(args.model, model_args, plan, cluster, args.profile_timeout)
    model_file = load_model_file(args.model)
    preflight(plan, model_file, model_args)  # what apply() would refuse on every rank, refused now
    model = _model_info(model_file, model_args, profile)
    claim_job_folder(spec, model)
    launched = launch(args.plan, args.model, model_args, spec)
    if spec.elastic and launched.result:  # recorded and predicted: the plan and world the job ended under
        plan = final_plan(launched.result, plan)
        cluster = _cluster(args, at_world(spec, plan))
        predicted, profile, note = _prediction(args.model, model_args, plan, cluster, args.profile_timeout)
    record = None
    if args.node_rank == 0:  # rank 0, its measurement and the trace live on node 0
        record = _record(plan, at_world(spec, plan), cluster, model, predicted, launched)
        if args.trace:
            append_record(args.trace, record)
        _show(console, record, launched, note)
        show_replans(console, record.measured)
    else:
        console.print(f"node {args.node_rank}: {launched.outcome}")
    if launched.outcome != "ok":  # the last line: the failing rank and its own error
        print(f"autopar: run failed ({launched.outcome}): {launched.error}", file=sys.stderr, flush=True)
        return 1
    if record is not None and not record.measured.get("parity_ok", True):  # beyond the precision's tolerance
        return 1
    return 0
