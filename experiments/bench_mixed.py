"""Mixed GPU clusters: the mixed plan against the best single group, and each mixed method's time and
quality (issue 42, acceptance 1; rl's figures for acceptance 2, with today's policy, not retrained).

On Llama 3 8B (seq 4096, global batch 256) on dgx-a100-80g:2,dgx-h100:2 and pcie-4090x8:2,dgx-a100-80g:2
(the inter-group link: each group's own NICs, the default), in one process with the profile cached, it
prints for each method the median of 3 wall times of `search_mixed`, the mixed plan's predicted tokens/s
over the best single group's (>= 1.05 wanted) and its tokens/s over the exact search's.

    python experiments/bench_mixed.py [--repeats 3] [--methods exhaustive,metis,rl] [--only a100-h100]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

from rich.console import Console
from rich.table import Table

from autopar.cli import build_parser
from autopar.cli.common import load_workload
from autopar.mixed.search import METHODS, search_mixed

WORKLOADS = {  # name -> the `autopar search` arguments (acceptance 1's commands)
    "a100-h100": "llama --model-arg size=llama3-8b --seq-len 4096 --global-batch 256 "
                 "--cluster dgx-a100-80g:2,dgx-h100:2",
    "4090-a100": "llama --model-arg size=llama3-8b --seq-len 4096 --global-batch 256 "
                 "--cluster pcie-4090x8:2,dgx-a100-80g:2",
}


def workload_of(args_text: str):
    """The mixed workload `autopar search ARGS` plans for (profile cached after the first call)."""
    return load_workload(build_parser().parse_args(["search", *shlex.split(args_text)]), mixed=True)


def timed(mw, method: str, repeats: int):
    """Median wall time of `search_mixed` over `repeats` runs (no memo shared between runs), and the last result."""
    walls, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = search_mixed(mw, method)
        walls.append(time.perf_counter() - started)
    return statistics.median(walls), result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--only", choices=list(WORKLOADS))
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    console = Console(width=160)
    table = Table(title=f"mixed search, medians of {args.repeats} (tokens/s predicted by the cost model)")
    for column in ("workload", "method", "planner s", "mixed tokens/s", "best single group", "its tokens/s",
                   "mixed / single", "vs exact"):
        table.add_column(column)
    plans = []
    for name, text in WORKLOADS.items():
        if args.only and name != args.only:
            continue
        console.print(f"{name}: autopar search {text}", soft_wrap=True)
        mw = workload_of(text)
        exact = None
        for method in sorted(methods, key=lambda m: m != "exhaustive"):  # the oracle first
            wall, result = timed(mw, method, args.repeats)
            if method == "exhaustive":
                exact = result.estimate.tokens_per_s
            group, _, single = result.best_single
            table.add_row(name, method, f"{wall:.2f}", f"{result.estimate.tokens_per_s:,.0f}", group,
                          f"{single.tokens_per_s:,.0f}", f"{result.gain:.3f}",
                          "" if exact is None else f"{result.estimate.tokens_per_s / exact:.3f}")
            plans.append(f"{name} {method}: {result.plan.describe()}")
    console.print(table)
    for line in plans:
        console.print(line, soft_wrap=True, markup=False)


if __name__ == "__main__":
    main()
