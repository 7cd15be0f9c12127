"""`autopar search MODEL --cluster A:n,B:m`: the best plan over a mixed cluster (issue 42), beside the best
plan of its fastest group alone, with the Why table of its lanes; `-o` writes the mixed plan JSON."""

from __future__ import annotations

import time

from rich.console import Console

from autopar.capability.mixed import mixed_refusals
from autopar.cli.common import load_workload, print_json
from autopar.cluster.mixed import MixedCluster, load_any_cluster
from autopar.errors import AutoparError
from autopar.executor.support import target
from autopar.mixed.search import METHODS, search_mixed
from autopar.mixed.why import summary, why_table
from autopar.report import params_text

HOMOGENEOUS_ONLY = ("fix", "policy", "storage", "study_name", "plot")  # flags the mixed search does not take


def is_mixed(args) -> bool:
    """Whether --cluster names a mixed cluster (a bad one fails here, in one line, as it would later)."""
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
    with console.status("profiling the model"):
        mw = load_workload(args, mixed=True)
    with console.status(f"searching ({args.method}, mixed)"):
        result = search_mixed(mw, args.method)
    if args.output:
        result.plan.save(args.output)
    best = result.best_single
    wall = time.perf_counter() - started
    est = result.estimate
    # what `autopar run` would refuse of it: the search weighs every plan the cost model prices, the
    # executor runs lanes of one layout or one spanning lane alone (autopar/capability/mixed.py)
    refused = mixed_refusals(result.plan, target())
    if args.json:
        print_json({
            "plan": result.plan.to_dict(), "estimate": est.to_dict(), "method": args.method,
            "single": {g: None if v is None else {"plan": v[0].to_dict(), "estimate": v[1].to_dict()}
                       for g, v in result.single.items()},
            "best_single": None if best is None else best[0], "gain": result.gain, "exact": result.exact,
            "search_s": result.seconds, "wall_time_s": wall, "run_refusal": refused[0] if refused else None,
        })
        return 0
    console.print(f"[bold]{mw.describe()}[/bold]  ·  {params_text(mw.profile.params)} parameters")
    for i, lane in enumerate(result.plan.lanes, 1):
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
