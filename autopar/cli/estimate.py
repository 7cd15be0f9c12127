"""`autopar estimate`: the cost model's figures for one given plan."""

from __future__ import annotations

from autopar.cli.common import add_workload_flags, load_workload, print_json, workload_dict
from autopar.errors import PlanError
from autopar.schema import PLAN_RANGES, check


def add_plan_flags(p) -> None:
    add_workload_flags(p, batch_default=None)
    p.add_argument("--plan", metavar="plan.json", help="a plan file (instead of the flags below)")
    p.add_argument("--dp", type=int)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro-batch", type=int, metavar="M")
    p.add_argument("--recompute", default="none", metavar="none|selective|full|N",
                   help="activation recompute: none, selective, full (all blocks) or N blocks per pipeline rank")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--schedule", default="1f1b", metavar="gpipe|1f1b|interleaved:V")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--grad-comm-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--mesh-order", default="pp,dp,tp", help="mesh axes, outermost first (default pp,dp,tp)")
    p.set_defaults(precision=None)  # the plan's precision with --plan, else bf16


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="estimate iteration time and memory of one plan",
                       description="Estimate one plan, given as --plan plan.json or as degree flags.")
    add_plan_flags(p)
    p.set_defaults(func=run)


def _fit_cluster_to(args, world: int) -> int:
    """Nodes for a plan of `world` ranks when --nodes is not given: whole nodes of the preset,
    or one partly used node for a plan smaller than a node."""
    from autopar.cluster import load_cluster

    if args.nodes is not None:
        return args.nodes
    gpn = args.gpus_per_node or load_cluster(args.cluster).gpus_per_node
    if world % gpn == 0:
        return world // gpn
    if world < gpn:
        args.gpus_per_node = world
        return 1
    raise PlanError(f"the plan needs {world} GPUs, not a multiple of {gpn} GPUs per node; "
                    f"pass --nodes and --gpus-per-node")


def _plan_from_flags(args, workload):
    from autopar.plan import PLAN_SCHEMA_VERSION, Plan, balanced_split, device_blocks

    batch = workload.global_batch
    if batch % (args.dp * args.micro_batch):
        raise PlanError(f"global batch {batch} is not divisible by dp x micro-batch = "
                        f"{args.dp * args.micro_batch}; change --global-batch or --micro-batch")
    schedule, _, v = args.schedule.partition(":")
    if v and not v.isdigit():
        raise PlanError(f"--schedule interleaved:V needs an integer V, got '{v}'")
    v = int(v or 1)
    mode, blocks = args.recompute, 0
    if mode not in ("none", "selective", "full"):
        if not mode.isdigit():
            raise PlanError(f"--recompute must be none, selective, full or a block count, got '{mode}'")
        mode, blocks = "full", int(mode)
    elif mode == "full":
        blocks = max(device_blocks(balanced_split(workload.profile.num_layers, args.pp * v), args.pp))
    return Plan.from_dict(dict(schema_version=PLAN_SCHEMA_VERSION, dp=args.dp, tp=args.tp, pp=args.pp,  # noqa: C408
                               micro_batch_size=args.micro_batch,
                num_micro_batches=batch // (args.dp * args.micro_batch),
                mesh_order=tuple(args.mesh_order.split(",")), zero=args.zero, bucket_mb=args.bucket_mb,
                recompute=mode, recompute_blocks=blocks, schedule=schedule, virtual_stages=v,
                sequence_parallel=args.sequence_parallel, precision=args.precision,
                grad_comm_dtype=args.grad_comm_dtype, offload_optimizer=args.offload_optimizer))


def plan_and_workload(args):
    """The plan from --plan or the flags, and the workload it runs on (cluster size and global
    batch default to the plan's)."""
    from autopar.plan import Plan

    if args.plan:
        plan = Plan.load(args.plan)
        if args.precision not in (None, plan.precision):
            raise PlanError(f"--precision {args.precision} but the plan trains in {plan.precision}; drop "
                            "--precision or edit the plan")
        args.precision = plan.precision
        workload = load_workload(args, nodes=_fit_cluster_to(args, plan.world_size), global_batch=plan.global_batch)
    else:
        args.precision = args.precision or "bf16"
        if args.dp is None or args.micro_batch is None:
            raise PlanError("give --plan plan.json, or at least --dp and --micro-batch (with --tp, --pp ...)")
        for flag in ("dp", "tp", "pp", "micro_batch"):  # before they size the cluster
            check(getattr(args, flag), PLAN_RANGES[flag.replace("micro_batch", "micro_batch_size")],
                  f"--{flag.replace('_', '-')}", PlanError)
        nodes = _fit_cluster_to(args, args.dp * args.tp * args.pp)
        workload = load_workload(args, nodes=nodes, global_batch=args.dp * args.micro_batch)
        plan = _plan_from_flags(args, workload)
    plan.validate(workload)
    return plan, workload


def run(args) -> int:
    from rich.console import Console

    from autopar.cost import estimate
    from autopar.report import print_estimate

    plan, workload = plan_and_workload(args)
    est = estimate(workload, plan)
    if args.json:
        print_json({**est.to_dict(), "plan": plan.to_dict(), "workload": workload_dict(workload)})
        return 0
    console = Console()
    console.print(f"[bold]{workload.describe()}[/bold]")
    print_estimate(console, plan, est)
    return 0
