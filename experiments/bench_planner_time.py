"""Planner time and plan quality, rl against the exact search, side by side (issue 41, acceptance 3 and 4).

On the issue's workloads (GPT-3 175B on 128 x dgx-a100-80g, Llama 3 405B on 2048 x dgx-h100 at 8K
tokens, free and held at pp=16, GPT 7.5B on 8 x dgx-h100 at 4K, a second GPT file
(`tests/models/gpt_sdpa.py`, written apart from the bundled one) at 175B, DeepSeek-V3 on 32 x
dgx-h100), in one process with the profile cached, it prints for each planner the median of 3 wall
times of `propose` (what `autopar search` spends planning) and its plan's predicted iteration time
against the exact search's; and the best uniform plan (balanced split, one recompute setting) against
the best plan, the gain the per-stage knobs bought, and whether the exact search proved its plan optimal
(every outer plan its lower bound could not rule out solved; how many it solved).

    python experiments/bench_planner_time.py [--repeats 3] [--planners rl,exhaustive] [--only 405b]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.cli import build_parser
from autopar.cli.common import load_workload
from autopar.cli.search import exactness
from autopar.cost import estimate
from autopar.search import get_planner
from autopar.search.fixed import parse_fixes, with_fixes

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # name -> the `autopar search` arguments (the commands)
    "175b": "gpt --model-arg size=175b --nodes 128 --global-batch 1536",
    "405b": "llama --model-arg size=llama3-405b --cluster dgx-h100 --nodes 2048 --global-batch 2048 --seq-len 8192",
    "405b-pp16": "llama --model-arg size=llama3-405b --cluster dgx-h100 --nodes 2048 --global-batch 2048 "
                 "--seq-len 8192 --fix pp=16",
    "7.5b": "gpt --model-arg size=7.5b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq-len 4096",
    "175b-file": f"{ROOT / 'tests' / 'models' / 'gpt_sdpa.py'} --model-arg size=175b --nodes 128 "
                 "--global-batch 1536",
    "deepseek-v3": "moe --model-arg size=deepseek-v3 --cluster dgx-h100 --nodes 32 --global-batch 4096 "
                   "--seq-len 4096",
}


def workload_of(args_text: str):
    """The workload `autopar search ARGS` plans for, profile cached (a first call profiles)."""
    args = build_parser().parse_args(["search", *shlex.split(args_text)])
    return with_fixes(load_workload(args), parse_fixes(args.fix))


def timed(planner_name: str, workload, repeats: int, **options):
    """Median wall time of `propose` over `repeats` fresh planners, the plan of the last, and the last planner
    (the exact search's `exact` and `solved` say whether it proved its plan optimal, after how many solves)."""
    walls, plan = [], None
    for _ in range(repeats):
        planner = get_planner(planner_name, **options)
        started = time.perf_counter()
        plan = planner.propose(workload, 1)[0]
        walls.append(time.perf_counter() - started)
    return statistics.median(walls), plan, planner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--planners", default="rl,exhaustive", help="comma-separated; the last is the reference")
    parser.add_argument("--only", help="comma-separated workload names (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    planners = args.planners.split(",")
    console = Console()
    table = Table(title=f"planner wall time (median of {args.repeats}, profile cached) and plan quality")
    table.add_column("workload")
    for p in planners:
        table.add_column(f"{p} s", justify="right")
        table.add_column(f"{p} / exact", justify="right")
    table.add_column("proved (solves)", justify="right")
    table.add_column("best uniform -> best", justify="right")
    table.add_column("best plan")
    for name in names:
        workload = workload_of(WORKLOADS[name])
        results = {p: timed(p, workload, args.repeats) for p in planners}
        exact_time = estimate(workload, results[planners[-1]][1]).iteration_time_s
        uniform = get_planner("exhaustive", per_stage=False).propose(workload, 1)[0]
        uniform_time = estimate(workload, uniform).iteration_time_s
        row = [name]
        for p in planners:
            wall, plan, _ = results[p]
            row += [f"{wall:.2f}", f"{exact_time / estimate(workload, plan).iteration_time_s:.4f}"]
        proof = exactness(results[planners[-1]][2])
        proved = f"{'yes' if proof['proved_optimal'] else 'no'} ({proof['outer_plans_solved']})" if proof else "-"
        row += [proved, f"{uniform_time / exact_time - 1:+.2%}", results[planners[-1]][1].describe()]
        table.add_row(*row)
        console.print(f"{name}: done")
    console.print(table)


if __name__ == "__main__":
    main()
