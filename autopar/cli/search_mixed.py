"""`autopar search MODEL --cluster A:n,B:m`: the best plan over a mixed cluster (issue 42), beside the best
plan of its fastest group alone, with the Why table of its lanes; `-o` writes the mixed plan JSON.
`--replan-from old.json`: the plan to continue an old mixed plan under on the new mix (autopar/mixed/replan.py)."""

from __future__ import annotations

import time

from rich.console import Console

from autopar.capability.mixed import mixed_refusals
from autopar.cli.common import DEFAULT_GLOBAL_BATCH, check_size_flags, load_workload, print_json
from autopar.cluster.mixed import MixedCluster, load_any_cluster
from autopar.cost import estimate
from autopar.errors import AutoparError
from autopar.executor.support import target
from autopar.mixed.cost import estimate_mixed
from autopar.mixed.plan import MixedPlan
from autopar.mixed.replan import replan_mixed
from autopar.mixed.search import METHODS, search_mixed
from autopar.mixed.why import summary, why_table
from autopar.report import params_text

HOMOGENEOUS_ONLY = ("fix", "policy", "storage", "study_name", "plot")  # flags the mixed search does not take


def add_replan_flag(p) -> None:
    p.add_argument("--replan-from", metavar="mixed.json",
                   help="a mixed plan to re-plan for the mix of --cluster (a group lost or gained nodes, joined or "
                        "left): keeps it where it still runs within 5%% of the new best, at its global batch; "
                        "use --method rl for a re-plan in seconds")


def is_mixed(args) -> bool:
    """Whether --cluster names a mixed cluster (a bad one fails here, in one line, as it would later)."""
    check_size_flags(args)
    return isinstance(load_any_cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node), MixedCluster)


def check_mixed_flags(args) -> None:
    """One line for a method or flag that plans one GPU type only (before the model is profiled)."""
    if args.method not in METHODS:
        raise AutoparError(f"--method {args.method} plans one GPU type; with a mixed cluster use "
                           f"{', '.join(METHODS[:-1])} or {METHODS[-1]}")
    for name in HOMOGENEOUS_ONLY:
        if getattr(args, name, None):
            raise AutoparError(f"--{name.replace('_', '-')} applies to one GPU type; leave it out with the mixed "
                               f"cluster {args.cluster}")


def run_mixed(args) -> int:
    check_mixed_flags(args)
    started = time.perf_counter()
    console = Console(stderr=args.json)
    old = _old_plan(args)
    with console.status("profiling the model"):
        mw = load_workload(args, mixed=True)
    with console.status(f"searching ({args.method}, mixed)"):
        if old is None:
            result, decided = search_mixed(mw, args.method), None
        else:
            decided, result = replan_mixed(old, mw, args.method)
    if result is None:  # one group left: a homogeneous plan
        return _one_group(args, mw, decided, console)
    plan = result.plan if decided is None else decided.plan
    est = result.estimate if plan is result.plan else estimate_mixed(mw, plan)
    if args.output:
        plan.save(args.output)
    best = result.best_single
    wall = time.perf_counter() - started
    # what `autopar run` would refuse of it: the search weighs every plan the cost model prices, the
    # executor runs lanes of one layout or one spanning lane alone (autopar/capability/mixed.py)
    refused = mixed_refusals(plan, target())
    if args.json:
        print_json({
            "plan": plan.to_dict(), "estimate": est.to_dict(), "method": args.method,
            "single": {g: None if v is None else {"plan": v[0].to_dict(), "estimate": v[1].to_dict()}
                       for g, v in result.single.items()},
            "best_single": None if best is None else best[0], "gain": result.gain, "exact": result.exact,
            "search_s": result.seconds, "wall_time_s": wall, "run_refusal": refused[0] if refused else None,
            "replan": None if decided is None else _replan_dict(decided),
        })
        return 0
    console.print(f"[bold]{mw.describe()}[/bold]  ·  {params_text(mw.profile.params)} parameters")
    if decided is not None:
        _say_replan(args, decided, console)
    for i, lane in enumerate(plan.lanes, 1):
        console.print(f"lane {i}: {lane.describe()}", markup=False)
    console.print(summary(est), markup=False)
    if best is None:
        console.print("best single group: none (no group alone fits the model at this batch)")
    else:
        console.print(f"best single group: {best[0]} alone, {best[2].tokens_per_s:,.0f} tokens/s "
                      f"({best[1].describe()}): the mixed plan is {result.gain:.2f}x", markup=False)
    alone = {g: v[1].tokens_per_s for g, v in result.single.items() if v is not None}
    table, lines = why_table(mw, est, alone)
    console.print(table)
    for line in lines:
        console.print(line, markup=False)
    if refused:
        console.print(f"autopar run cannot run this plan yet (it is the cost model's answer): {refused[0]}",
                      markup=False)
    console.print(f"{args.method} (mixed): {result.seconds:.2f} s searching, {wall:.2f} s in all"
                  + ("" if result.exact else "; the time limit cut the share grid short")
                  + (f"; plan written to {args.output}" if args.output else ""))
    return 0


def _old_plan(args) -> MixedPlan | None:
    """The mixed plan --replan-from names (its global batch is the one planned), or None."""
    if not getattr(args, "replan_from", None):
        return None
    old = MixedPlan.load(args.replan_from)
    if args.global_batch not in (DEFAULT_GLOBAL_BATCH, old.global_batch):
        raise AutoparError(f"--global-batch {args.global_batch}: {args.replan_from} trains {old.global_batch} samples "
                           f"per step and a re-plan keeps them; leave --global-batch out")
    args.global_batch = old.global_batch
    return old


def _one_group(args, w, decided, console) -> int:
    """A re-plan onto one group: its homogeneous plan, the decision, `-o` writing plan.json."""
    if args.output:
        decided.plan.save(args.output)
    est = estimate(w, decided.plan)
    if args.json:
        print_json({"plan": decided.plan.to_dict(), "estimate": est.to_dict(), "method": args.method,
                    "replan": _replan_dict(decided)})
        return 0
    _say_replan(args, decided, console)
    console.print(f"{w.describe()}: {decided.plan.describe()}, {est.tokens_per_s:,.0f} tokens/s"
                  + (f"; plan written to {args.output}" if args.output else ""), markup=False)
    return 0


def _replan_dict(decided) -> dict:
    """The re-plan decision as --json gives it."""
    return {"decision": decided.decision, "reason": decided.reason, "planning_s": decided.planning_s,
            "predicted_old_s": decided.predicted_old_s, "predicted_new_s": decided.predicted_new_s}


def _say_replan(args, decided, console) -> None:
    console.print(f"re-plan from {args.replan_from}: {decided.decision} in {decided.planning_s:.2f} s: "
                  f"{decided.reason}", markup=False)
