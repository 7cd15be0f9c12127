"""`autopar explain PLAN MODEL`: why a saved plan, with its estimate, and (--plot) a picture of
one iteration per pipeline rank and of the memory per GPU."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from autopar.cli.common import add_workload_flags, print_json, workload_dict
from autopar.cli.estimate import plan_and_workload
from autopar.cost import estimate
from autopar.cost.regime import json_notes, notes
from autopar.errors import AutoparError
from autopar.explain import explain
from autopar.plots.figures import plan_figure, pyplot
from autopar.report import print_estimate, why_table
from autopar.stage_table import is_per_stage, rank_rows, stage_reason, stage_table

DEFAULT_PLOT = "plan.png"


def add_plot_flag(p) -> None:
    p.add_argument("--plot", nargs="?", const=DEFAULT_PLOT, metavar="FILE.png",
                   help=f"draw the iteration timeline per pipeline rank and the memory per GPU (default file "
                        f"{DEFAULT_PLOT}; needs matplotlib: pip install 'autopar[plots]')")


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="explain a saved plan: estimate, reasons, and a picture (--plot)",
                       description="Estimate PLAN on MODEL (cluster size and global batch default to the "
                                   "plan's), say for every knob what the best alternative would cost, and draw "
                                   "one iteration with --plot.")
    p.add_argument("plan", metavar="PLAN", help="a plan.json written by `autopar search -o`")
    add_workload_flags(p, batch_default=None)
    add_plot_flag(p)
    p.set_defaults(func=run, precision=None)  # the plan's precision unless --precision says otherwise


def check_plot(args) -> None:
    """Fail on a missing matplotlib or an unusable --plot path before any work or output."""
    if not args.plot:
        return

    pyplot()
    if Path(args.plot).is_dir():
        raise AutoparError(f"--plot {args.plot} is a directory; give a file name such as {DEFAULT_PLOT}")


def draw(args, workload, plan, est) -> str | None:
    """Write the plot when --plot was given; the path written."""
    if not args.plot:
        return None

    plan_figure(workload, plan, est, args.plot, headroom_bytes=est.gpu_memory_bytes - est.usable_memory_bytes)
    return args.plot


def run(args) -> int:
    check_plot(args)
    plan, workload = plan_and_workload(args)
    est = estimate(workload, plan)
    reasons = explain(workload, plan) + stage_reason(workload, plan)
    ranks = rank_rows(workload, plan) if is_per_stage(workload, plan) else None  # the per-stage table
    written = draw(args, workload, plan, est)
    if args.json:
        print_json({"plan": plan.to_dict(), "estimate": est.to_dict(), "workload": workload_dict(workload),
                    "why": [{"knob": r.knob, "chosen": r.chosen, "instead": r.text} for r in reasons],
                    "stages": None if ranks is None else [r.to_dict() for r in ranks],
                    **json_notes(workload, plan, est),
                    "plot": written})
        return 0
    console = Console()
    console.print(f"[bold]{workload.describe()}[/bold]")
    print_estimate(console, plan, est)
    if ranks is not None:
        console.print(stage_table(ranks, workload.memory_budget))
    for note in notes(workload, plan, est):
        console.print(f"[yellow]{note}[/yellow]")
    console.print(why_table(est, reasons))
    if written:
        console.print(f"plot written to {written}")
    return 0
