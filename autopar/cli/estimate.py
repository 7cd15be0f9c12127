"""`autopar estimate`: the cost model's figures for one given plan."""

from __future__ import annotations

import sys

from rich.console import Console

from autopar import axes
from autopar.capability.mixed import one_precision_problem
from autopar.cli.common import add_workload_flags, load_workload, print_json, workload_dict
from autopar.cluster import load_cluster
from autopar.cluster.io import spec_identity
from autopar.cluster.mixed import MixedCluster, load_any_cluster
from autopar.cost import estimate
from autopar.cost.regime import json_notes, notes
from autopar.errors import PlanError
from autopar.knobs import FP8_RECIPES, balanced_split, decisions, device_blocks, knob
from autopar.mixed.cost import estimate_mixed
from autopar.mixed.plan import MixedPlan, load_if_mixed
from autopar.mixed.why import summary as mixed_summary
from autopar.mixed.why import why_table
from autopar.plan import Plan
from autopar.report import print_estimate
from autopar.schema import PLAN_RANGES, check
from autopar.search.space import plan_of

OLD_FLAGS = {"--micro-batch": "micro_batch_size"}  # flags of earlier versions, still read


def add_plan_flags(p) -> None:
    """--plan, or one flag per axis and decision knob of the registry (`autopar.knobs`), named as
    its Plan field; a knob left out takes its declared default."""

    add_workload_flags(p, batch_default=None)
    p.add_argument("--plan", metavar="plan.json", help="a plan file (instead of the flags below)")
    dp = axes.derived_axis()
    p.add_argument(f"--{dp}", type=int, help=axes.AXES[dp].help)
    for k in decisions():
        f = k.fields[0]
        names = [k.flag] + [old for old, new in OLD_FLAGS.items() if new == k.name]
        if f.kind is bool and len(k.fields) == 1:
            p.add_argument(*names, dest=k.name, action="store_true", default=None, help=k.flag_help)
            continue
        choices = [str(v) for v in f.values] if f.values is not None and len(k.fields) == 1 else None
        p.add_argument(*names, dest=k.name, default=None, help=k.flag_help, choices=choices,
                       metavar=None if choices else k.name.upper().replace("_", "-"))  # parsed in _flag_value
    per_stage = knob("stage_recompute")  # not a decision (the per-stage solver fills it), but a plan can name it
    p.add_argument(per_stage.flag, dest=per_stage.name, default=None, help=per_stage.flag_help, metavar="ENTRIES")
    p.set_defaults(precision=None)  # the plan's precision with --plan, else the device's default


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="estimate iteration time and memory of one plan",
                       description="Estimate one plan, given as --plan plan.json or as degree flags.")
    add_plan_flags(p)
    p.set_defaults(func=run)


def _fit_cluster_to(args, world: int) -> int:
    """Nodes for a plan of `world` ranks when --nodes is not given: whole nodes of the preset,
    or one partly used node for a plan smaller than a node."""

    if args.nodes is not None:
        return args.nodes
    gpn = args.gpus_per_node or load_cluster(args.cluster).gpus_per_node
    if world % gpn == 0:
        return world // gpn
    if world < gpn:
        if args.gpus_per_node is not None:  # said, not the preset's: a node the plan does not fill is not priced
            raise PlanError(f"the plan needs {world} GPUs, fewer than --gpus-per-node {gpn}; drop --gpus-per-node "
                            f"(the plan then runs on one node of {world}) or plan for {gpn} GPUs")
        args.gpus_per_node = world
        return 1
    raise PlanError(f"the plan needs {world} GPUs, not a multiple of {gpn} GPUs per node; "
                    f"pass --nodes and --gpus-per-node")


def _plan_from_flags(args, workload):
    batch, dp, mbs = workload.global_batch, getattr(args, axes.derived_axis()), args.micro_batch_size
    if batch % (dp * mbs):
        raise PlanError(f"global batch {batch} is not divisible by dp x micro-batch = "
                        f"{dp * mbs}; change --global-batch or --micro-batch-size")
    values = {k.name: getattr(args, k.name) for k in decisions()}
    values.update({axes.derived_axis(): dp, "num_micro_batches": batch // (dp * mbs), "precision": args.precision})
    values["mesh_order"] = values["mesh_order"] or axes.default_order()
    values["stage_recompute"] = args.stage_recompute
    if values["precision"] == "fp8" and values["fp8_recipe"] == "none":  # no --fp8-recipe: the first recipe
        values["fp8_recipe"] = FP8_RECIPES[0]
    mode, blocks = values["recompute"]
    if blocks is None:  # --recompute full: every block of the busiest pipeline rank
        pp, (schedule, v) = values["pp"], values["schedule"]
        values["recompute"] = (mode, max(device_blocks(balanced_split(workload.profile.num_layers, pp * v), pp,
                                                       schedule)))
    # through the plan file's schema: flags get the same ranges and finiteness checks as plan.json
    return Plan.from_dict(plan_of(workload, values).to_dict())


def _flag_value(k, given):
    """A knob's value from its flag's text (its default when the flag is not given)."""
    if given is None:
        return k.default
    if not isinstance(given, str):
        return given
    try:
        return (k.parse or k.fields[0].kind)(given)
    except ValueError:
        raise PlanError(f"{k.flag} takes {k.fields[0].kind.__name__} values, got '{given}'") from None


def _flag_world(args) -> int:
    out = 1
    for a in axes.AXES:
        out *= getattr(args, a) or 1
    return out


def warn_other_cluster(plan: Plan, cluster: str) -> None:
    """One line on stderr when the plan was searched for another cluster than the one it is priced on."""
    if plan.searched_on is not None and plan.searched_on != spec_identity(cluster):
        print(f"autopar: note: the plan was searched for --cluster {plan.searched_on}; this prices it on {cluster} "
              f"(pass --cluster {plan.searched_on} to price it where it was planned)", file=sys.stderr)


def plan_and_workload(args):
    """The plan from --plan or the flags, and the workload it runs on (cluster size and global
    batch default to the plan's)."""

    if args.plan:
        plan = Plan.load(args.plan)
        if args.precision not in (None, plan.precision):
            raise PlanError(f"--precision {args.precision} but the plan trains in {plan.precision}; drop "
                            "--precision or edit the plan")
        args.precision = plan.precision
        warn_other_cluster(plan, args.cluster)
        workload = load_workload(args, nodes=_fit_cluster_to(args, plan.world_size), global_batch=plan.global_batch)
    else:
        if args.dp is None or args.micro_batch_size is None:
            raise PlanError("give --plan plan.json, or at least --dp and --micro-batch-size (with --tp, --pp ...)")
        for k in (*decisions(), knob("stage_recompute")):
            setattr(args, k.name, _flag_value(k, getattr(args, k.name)))
        args.dp = _flag_value(knob(axes.derived_axis()), args.dp)
        for name in (*axes.AXES, "micro_batch_size"):  # before they size the cluster
            if name in PLAN_RANGES:
                check(getattr(args, name), PLAN_RANGES[name], f"--{name.replace('_', '-')}", PlanError)
        nodes = _fit_cluster_to(args, _flag_world(args))
        workload = load_workload(args, nodes=nodes, global_batch=args.dp * args.micro_batch_size)
        plan = _plan_from_flags(args, workload)
    plan.validate(workload)
    return plan, workload


def run(args) -> int:
    mixed = load_if_mixed(args.plan) if args.plan else None
    if mixed is not None:
        return _run_mixed(args, mixed)
    if isinstance(load_any_cluster(args.cluster), MixedCluster):
        raise PlanError(f"--cluster {args.cluster} is a mixed cluster: give a mixed plan, --plan mixed.json "
                        "(`autopar search MODEL --cluster A:n,B:m -o mixed.json` writes one)")
    plan, workload = plan_and_workload(args)
    est = estimate(workload, plan)
    if args.json:
        print_json({**est.to_dict(), "plan": plan.to_dict(), "workload": workload_dict(workload),
                    **json_notes(workload, plan, est)})
        return 0
    console = Console()
    console.print(f"[bold]{workload.describe()}[/bold]")
    print_estimate(console, plan, est)
    for note in notes(workload, plan, est):
        console.print(f"[yellow]{note}[/yellow]")
    return 0


def _run_mixed(args, mp: MixedPlan) -> int:
    """A mixed plan on a mixed --cluster: the mixed estimate and its Why table (autopar/mixed/)."""
    if not isinstance(load_any_cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node),
                      MixedCluster):
        raise PlanError(f"{args.plan} is a mixed plan over groups {', '.join(mp.groups)}; give the mixed cluster "
                        "it plans for, --cluster A:n,B:m or a cluster JSON with groups")
    precisions = sorted({lane.plan.precision for lane in mp.lanes})
    problem = one_precision_problem(precisions, args.precision)
    if problem:
        raise PlanError(problem)
    args.precision = precisions[0]
    workload = load_workload(args, global_batch=mp.global_batch, mixed=True)
    est = estimate_mixed(workload, mp)
    if args.json:
        print_json({**est.to_dict(), "plan": mp.to_dict(),
                    "workload": {"model": workload.profile.name, "cluster": workload.cluster.name,
                                 "groups": list(workload.cluster.group_names), "global_batch": workload.global_batch,
                                 "seq_len": workload.profile.seq_len}})
        return 0
    console = Console()
    console.print(f"[bold]{workload.describe()}[/bold]")
    for i, lane in enumerate(mp.lanes, 1):
        console.print(f"lane {i} ({lane.share} samples): {lane.describe()}", markup=False, highlight=False)
    console.print(mixed_summary(est), highlight=False)
    table, reasons = why_table(workload, est)
    console.print(table)
    for line in reasons:
        console.print(line, markup=False, highlight=False)
    return 0
