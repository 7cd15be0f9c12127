"""`autopar search`: find the best plan, explain it, list the runners-up, write plan.json."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

from rich.console import Console

from autopar.cli.common import add_fix_flag, add_workload_flags, load_workload, print_json, workload_dict
from autopar.cli.explain import add_plot_flag, check_plot, draw
from autopar.cli.search_inventory import add_inventory_flags, check_inventory_flags, run_inventory
from autopar.cli.search_mixed import add_replan_flag, is_mixed, run_mixed
from autopar.cost import estimate
from autopar.cost.regime import json_notes, notes
from autopar.errors import AutoparError
from autopar.explain import explain
from autopar.report import alternatives_table, params_text, print_estimate, why_table
from autopar.search import get_planner
from autopar.search.fixed import parse_fixes, searched, with_fixes
from autopar.stage_table import is_per_stage, rank_rows, stage_reason, stage_table

# the exact search: it proves its plan the space's optimum, in 0.3-2.2 s on issue 41's workloads, within 3x of
# the rl planner's 0.6-0.9 s at 0.995-1.000 of it (experiments/bench_planner_time.py; README "Planners")
DEFAULT_METHOD = "exhaustive"


def add_parser(sub) -> None:
    p = sub.add_parser("search", help="find the best parallel plan for a model on a cluster",
                       description="Profile MODEL, search the plan space and print the best plan with "
                                   "its estimate, the reasons for each choice, and the runners-up.")
    add_workload_flags(p)
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"planner: exhaustive, rules, rl, optuna or random (default {DEFAULT_METHOD}); on a mixed "
                        "cluster (--cluster A:N,B:M): exhaustive, metis or rl")
    p.add_argument("--policy", metavar="policy.zip", help="rl: a trained policy (default: the shipped one)")
    p.add_argument("--trials", type=int, default=200, help="optuna/random: cost-model evaluations (default 200)")
    p.add_argument("--storage", metavar="URL",
                   help="optuna: study storage, resumable: sqlite:///study.db, or a database server that processes "
                        "on several machines share, postgresql://user:password@host/db (docs/cluster.md)")
    p.add_argument("--study-name", help="optuna: study name within the storage")
    p.add_argument("--seed", type=int, default=0, help="optuna/random/rl sampling seed (default 0)")
    add_fix_flag(p, "; the plan file records it, and elastic re-plans keep it")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="plans to show (default 5)")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the best plan here (on a mixed cluster: the "
                                                               "mixed plan)")
    add_plot_flag(p)
    add_inventory_flags(p)
    add_replan_flag(p)
    p.set_defaults(func=run)


def planner_options(args) -> dict:
    """The flags that concern the chosen method, as keyword arguments of its planner."""
    return {
        "rl": {"policy": args.policy, "seed": args.seed},
        "optuna": {"trials": args.trials, "storage": args.storage, "study_name": args.study_name, "seed": args.seed},
        "random": {"trials": args.trials, "seed": args.seed},
    }.get(args.method, {})


def check_method_flags(args) -> None:
    """A flag of another method is refused, not ignored."""
    if args.policy and args.method != "rl":
        raise AutoparError(f"--policy is the rl planner's, not {args.method}'s; add --method rl")
    if args.policy and (args.replan_from or args.inventory or is_mixed(args)):
        raise AutoparError("--policy: the rl planner of several GPU types uses the shipped policy; leave --policy out")
    if (args.storage or args.study_name) and args.method != "optuna":
        raise AutoparError(f"--storage and --study-name are the optuna planner's, not {args.method}'s; add "
                           f"--method optuna")


def run(args) -> int:
    check_method_flags(args)
    if args.inventory and args.replan_from:
        raise AutoparError("--replan-from re-plans on the mix --cluster names; leave --inventory out")
    if args.inventory:  # which nodes to rent, then the plan on them
        return run_inventory(args)
    check_inventory_flags(args)
    if args.replan_from or is_mixed(args):  # several GPU types (a re-plan: or what is left of them)
        return run_mixed(args)
    if args.method == "metis":
        raise AutoparError("--method metis plans mixed clusters (--cluster A:N,B:M); on one GPU type use exhaustive, "
                           "rules, rl, optuna or random")
    if args.top_k < 1:
        raise AutoparError(f"--top-k must be at least 1, got {args.top_k}")
    if not 0 <= args.seed < 2**32:
        raise AutoparError(f"--seed must be an integer in [0, 2**32), got {args.seed}")
    check_plot(args)  # a missing matplotlib fails before the search, not after it
    started = time.perf_counter()
    console = Console(stderr=args.json)
    planner = get_planner(args.method, **planner_options(args))  # a bad method or option fails before profiling
    fixed = parse_fixes(args.fix)  # a bad --fix too
    with console.status("profiling the model"):
        workload = with_fixes(load_workload(args), fixed)
    # optuna shows its own progress bar; a spinner beside it would flicker
    status = contextlib.nullcontext() if args.method == "optuna" else console.status(f"searching ({args.method})")
    with status:
        plans = planner.propose(workload, args.top_k)
    estimates = [estimate(workload, p) for p in plans]
    confidence = getattr(planner, "last_confidence", None)  # planners that can be unsure say so
    best, best_est = plans[0], estimates[0]
    # the Why table weighs every knob in the whole space, the held ones too (what holding them costs)
    whole = dataclasses.replace(workload, fixed=())
    reasons = explain(whole, best, fastest=min(e.iteration_time_s for e in estimates)) + stage_reason(whole, best)
    ranks = rank_rows(workload, best) if is_per_stage(workload, best) else None  # the per-stage table
    if args.output:  # with what it was searched under: a re-plan keeps the held knobs and any you edit
        searched(best, fixed, args.cluster).save(args.output)
    written = draw(args, workload, best, best_est)
    wall = time.perf_counter() - started
    note = getattr(planner, "stale_note", None)  # a policy trained against an older cost model: said once
    if note:  # the search succeeded (bad input is one line, without it)
        print(note, file=sys.stderr)
    if args.json:
        print_json({
            "plan": best.to_dict(), "estimate": best_est.to_dict(),
            "alternatives": [{"plan": p.to_dict(), "estimate": e.to_dict()}
                             for p, e in zip(plans[1:], estimates[1:])],
            "why": [{"knob": r.knob, "chosen": r.chosen, "instead": r.text} for r in reasons],
            "stages": None if ranks is None else [r.to_dict() for r in ranks],
            "workload": workload_dict(workload), "method": args.method,
            "fixed": {name: k_value for name, k_value in workload.fixed},
            **json_notes(workload, best, best_est),
            "confidence": None if confidence is None else {"probability": confidence.probability,
                                                           "min_step": confidence.min_step},
            "cost_model_evaluations": planner.evaluations, "wall_time_s": wall, "plot": written,
            **exactness(planner),
        })
        return 0
    console.print(f"[bold]{workload.describe()}[/bold]  ·  {params_text(workload.profile.params)} parameters")
    if not workload.profile.has_tp_plan:
        console.print(f"[yellow]{workload.profile.tp_note}[/yellow]")
    for note in workload.profile.notes:
        console.print(note, style="yellow", markup=False)
    print_estimate(console, best, best_est)
    if ranks is not None:
        console.print(stage_table(ranks, workload.memory_budget))
    for note in notes(workload, best, best_est):
        console.print(f"[yellow]{note}[/yellow]")
    console.print(why_table(best_est, reasons))
    if len(plans) > 1:
        console.print(alternatives_table(best_est, list(zip(plans[1:], estimates[1:]))))
    if confidence is not None:
        console.print(confidence.describe())
    proof = exactness(planner)
    solved = ("" if not proof else f", {proof['outer_plans_solved']:,} outer plans solved per stage "
              + ("(optimum proved)" if proof["proved_optimal"] else "(stopped at the cap: optimum not proved)"))
    # the exact search prices a plan with recompute only where it could matter (search/pricing.py)
    bounded = (f" of {proof['plans_in_space']:,} plans" if proof and proof["plans_in_space"] > planner.evaluations
               else "")
    console.print(f"{args.method}: {planner.evaluations:,} cost-model evaluations{bounded}{solved}, {wall:.2f} s"
                  + (f"; plan written to {args.output}" if args.output else "")
                  + (f"; plot written to {written}" if written else ""))
    return 0


def exactness(planner) -> dict:
    """What the exact search proved (`ExhaustivePlanner.exact`: every outer plan its lower bound could not rule
    out was finished per stage, so no plan of the space is predicted faster), for the JSON and the last line;
    nothing for the other planners."""
    if not hasattr(planner, "exact"):
        return {}
    return {"proved_optimal": bool(planner.exact), "outer_plans_solved": int(planner.solved),
            "plans_in_space": int(planner.plans)}
