"""`autopar memory`: the memory accounting of one plan, by component."""

from __future__ import annotations

from rich.console import Console

from autopar.cli.common import print_json
from autopar.cli.estimate import add_plan_flags, plan_and_workload
from autopar.cost import estimate
from autopar.report import estimate_tables


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="memory per GPU of one plan, by component",
                       description="Weights, gradients, master weights, optimizer states, activations, "
                                   "buffers and workspace on the most loaded GPU, in GB.")
    add_plan_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    plan, workload = plan_and_workload(args)
    est = estimate(workload, plan)
    if args.json:
        print_json({"plan": plan.to_dict(), "memory_gb": est.to_dict()["memory_gb"],
                    "peak_memory_gb": est.peak_memory_bytes / 1e9, "gpu_memory_gb": est.gpu_memory_bytes / 1e9,
                    "usable_memory_gb": est.usable_memory_bytes / 1e9,
                    "fits": est.fits})
        return 0
    Console().print(estimate_tables(est)[1])
    return 0
