"""`autopar search MODEL --inventory inv.json --objective time|cost`: which nodes of which GPUs to rent, the
plan on them, and the time/cost frontier of the choices (autopar/mixed/inventory.py)."""

from __future__ import annotations

import dataclasses
import time

from rich.console import Console
from rich.table import Table

from autopar.cli.common import DEFAULT_CLUSTER, load_workload, print_json
from autopar.cli.explain import check_plot
from autopar.errors import AutoparError
from autopar.mixed.inventory import OBJECTIVES, Goal, check_budget, choose, common_precision, frontier, \
    load_inventory, plan_choices
from autopar.mixed.plan import MixedPlan
from autopar.mixed.search import METHODS, search_mixed
from autopar.plots.frontier import frontier_figure
from autopar.report import params_text, print_estimate

FLAGS = ("objective", "budget_per_hour", "deadline_hours", "train_tokens")


def add_inventory_flags(p) -> None:
    g = p.add_argument_group("choosing the cluster (--inventory)")
    g.add_argument("--inventory", metavar="inv.json",
                   help="choose the nodes to rent from this inventory of GPU presets (nodes available, price per "
                        "GPU-hour; examples/inventory.json) instead of planning one --cluster")
    g.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="with --inventory: time (the fastest choice, within --budget-per-hour; default) or cost "
                        "(the cheapest choice that trains --train-tokens within --deadline-hours)")
    g.add_argument("--budget-per-hour", type=float, metavar="X", help="with --inventory: dollars per hour at most")
    g.add_argument("--deadline-hours", type=float, metavar="H",
                   help="with --inventory: train --train-tokens within H hours")
    g.add_argument("--train-tokens", type=float, metavar="T",
                   help="with --inventory: tokens to train (e.g. 2e11): hours and dollars per choice")


def check_inventory_flags(args) -> None:
    """The inventory flags without --inventory, and the single-cluster flags with it, are one line each."""
    if not getattr(args, "inventory", None):
        given = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f, None) is not None]
        if given:
            raise AutoparError(f"{', '.join(given)} choose among the nodes of an inventory: add --inventory inv.json "
                               "(see examples/inventory.json)")
        return
    for flag, bad in (("--cluster", args.cluster != DEFAULT_CLUSTER), ("--nodes", args.nodes is not None),
                      ("--gpus-per-node", args.gpus_per_node is not None), ("--fix", bool(args.fix))):
        if bad:
            raise AutoparError(f"--inventory chooses the cluster (the nodes of each group); leave out {flag}")
    if args.method not in METHODS:
        raise AutoparError(f"--method {args.method} plans one GPU type; with --inventory (choices of several "
                           f"groups) use {', '.join(METHODS[:-1])} or {METHODS[-1]}")


def run_inventory(args) -> int:
    started = time.perf_counter()
    check_inventory_flags(args)
    goal = Goal(args.objective or "time", args.budget_per_hour, args.deadline_hours, args.train_tokens)
    check_plot(args)  # a missing matplotlib or a directory fails before the search
    inventory = load_inventory(args.inventory)
    check_budget(inventory, goal)  # before the model is profiled
    args.precision = common_precision(inventory.offers, args.precision)
    console = Console(stderr=args.json)
    with console.status("profiling the model"):
        first = inventory.offers[0]
        args.cluster, args.nodes = first.preset, first.nodes  # the profile: any group's cluster will do
        base = dataclasses.replace(load_workload(args), cluster=first.cluster)
    with console.status("planning the choices") as status:
        options, failed = plan_choices(
            base, inventory, mixed=lambda mw: _mixed(mw, args.method), goal=goal,
            progress=lambda done, total: status.update(f"planned {done} of {total} choices ({args.method})"))
    chosen = choose(options, goal, failed)
    front = frontier([o for o in options if goal.meets(o)])
    if args.output:
        chosen.plan.save(args.output)
    if args.plot:
        frontier_figure(options, front, chosen, goal, args.plot)
    wall = time.perf_counter() - started
    if args.json:
        print_json({"inventory": args.inventory, "goal": dataclasses.asdict(goal), "choice": _option_dict(chosen, goal),
                    "plan": chosen.plan.to_dict(), "estimate": chosen.estimate.to_dict(),
                    "frontier": [_option_dict(o, goal) for o in front],
                    "choices": len(options) + len(failed), "without_plan": failed,
                    "cluster": chosen.workload.cluster.to_dict(), "model": base.profile.name,
                    "global_batch": base.global_batch, "precision": base.precision, "method": args.method,
                    "wall_time_s": wall, "plot": args.plot})
        return 0
    p = base.profile
    console.print(f"[bold]{p.name}[/bold] · {params_text(p.params)} parameters, global batch {base.global_batch}, "
                  f"seq {p.seq_len}, {base.precision}; inventory {inventory.name}: "
                  + ", ".join(f"{o.name} ({o.nodes} x {o.cluster.gpus_per_node} {o.cluster.gpu.name}, "
                              f"${o.price_per_gpu_hour:g}/GPU-hour)" for o in inventory.offers), highlight=False)
    console.print(f"[bold]choice: {chosen.label}[/bold] ({_answer(chosen, goal)})", highlight=False)
    if isinstance(chosen.plan, MixedPlan):
        print_mixed(console, chosen.plan, chosen.estimate)
    else:
        print_estimate(console, chosen.plan, chosen.estimate)
    console.print(frontier_table(front, chosen, goal))
    for why, labels in _by_reason(failed).items():
        console.print(f"{', '.join(labels)}: {why}", style="yellow", markup=False, highlight=False)
    console.print(f"{len(options) + len(failed)} choices of nodes, {len(options)} with a plan, "
                  f"{sum(goal.meets(o) for o in options)} meeting the goal; {args.method} search for the choices of "
                  f"several groups; {wall:.1f} s"
                  + (f"; plan written to {args.output}" if args.output else "")
                  + (f"; plot written to {args.plot}" if args.plot else ""), highlight=False)
    return 0


def _mixed(mw, method: str):
    """The mixed search's plan and estimate for a choice of several groups."""
    result = search_mixed(mw, method)
    return result.plan, result.estimate


def print_mixed(console, plan, est) -> None:
    """A mixed plan lane by lane (each lane's samples per step, its groups and knobs) and its prediction."""
    for i, lane in enumerate(plan.lanes, 1):
        console.print(f"lane {i}: {lane.share} samples per step on "
                      + ", ".join(f"{s.group} ({lane.segment_gpus(s)} GPUs, tp{s.tp} x {s.stages} stages)"
                                  for s in lane.segments) + f": {lane.plan.describe()}", markup=False, highlight=False)
    console.print(f"predicted: {est.tokens_per_s:,.0f} tokens/s, {est.iteration_time_s:.3f} s per step, MFU "
                  f"{est.mfu:.1%}", highlight=False)


def _by_reason(failed: dict[str, str]) -> dict[str, list[str]]:
    """{why: the choices it left without a plan}: one line per reason, not per choice."""
    out: dict[str, list[str]] = {}
    for label, why in failed.items():
        out.setdefault(why, []).append(label)
    return out


def _answer(o, goal: Goal) -> str:
    """The choice's figures in words."""
    text = f"{o.gpus} GPUs, {o.tokens_per_s:,.0f} tokens/s, ${o.price_per_hour:,.2f}/hour"
    if goal.train_tokens:
        text += (f"; {goal.train_tokens:,.4g} tokens in {o.hours(goal.train_tokens):,.1f} hours for "
                 f"${o.dollars(goal.train_tokens):,.0f}")
    else:
        text += f", ${o.dollars_per_mtoken:,.3f} per million tokens"
    return text


def frontier_table(front, chosen, goal: Goal) -> Table:
    """The frontier fastest first: no row is both slower and dearer than another."""
    t = Table(title=f"Time/cost frontier ({'meeting the goal' if front else 'none meets the goal'}: no row is "
                    "both slower and dearer than another)", title_justify="left")
    columns = ["", "nodes", "GPUs", "tokens/s", "$/hour"]
    columns += ["hours", "$"] if goal.train_tokens else ["$ per M tokens"]
    columns += ["plan"]
    for col in columns:
        t.add_column(col, justify="left" if col in ("", "nodes", "plan") else "right", overflow="fold")
    for o in front:
        cells = ["*" if o is chosen else "", o.label, str(o.gpus), f"{o.tokens_per_s:,.0f}", f"{o.price_per_hour:,.2f}"]
        if goal.train_tokens:
            cells += [f"{o.hours(goal.train_tokens):,.1f}", f"{o.dollars(goal.train_tokens):,.0f}"]
        else:
            cells += [f"{o.dollars_per_mtoken:,.4g}"]
        t.add_row(*cells, short(o.plan))
    return t


def short(plan) -> str:
    """A plan in a table cell: a homogeneous plan's label; a mixed plan's samples per step on each lane's groups
    (the chosen one is printed in full above)."""
    if not isinstance(plan, MixedPlan):
        return plan.describe()
    return " | ".join(f"{lane.share} on {'+'.join(s.group for s in lane.segments)}" for lane in plan.lanes)


def _option_dict(o, goal: Goal) -> dict:
    d = {"nodes": o.label, "gpus": o.gpus, "tokens_per_s": o.tokens_per_s, "price_per_hour": o.price_per_hour,
         "dollars_per_million_tokens": o.dollars_per_mtoken, "plan": o.plan.describe()}
    if goal.train_tokens:
        d.update(hours=o.hours(goal.train_tokens), dollars=o.dollars(goal.train_tokens))
    return d

