"""The RL policy zero-shot on the held-out workloads, against the exhaustive oracle and the rules.

For each held-out workload (shapes and clusters no training run saw; --family: of one zoo
family) the ratio of the plan's predicted throughput to the oracle's best (both under the cost
model), for rl greedy (the policy alone), rl top-8 (beam of 8, ranked by the cost model), rl
(the default output: the same 8 refined by coordinate descent, ranked) and the rules of thumb;
how often rl greedy beats the rules; cost-model evaluations and wall time per workload.

    python experiments/rl_heldout.py [--policy policy.zip] [--family moe --n 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.envs.rewards import CostModelReward
from autopar.envs.workloads import HELDOUT_SEED, HELDOUT_SIZE, families, heldout_workloads
from autopar.errors import NoValidPlanError
from autopar.search import get_planner

TIE = 1e-3  # ratios closer than this are the same plan quality


def run_planner(planner, workload, k: int, reward) -> dict:
    started = time.perf_counter()
    try:
        plan = planner.propose(workload, k)[0]
    except NoValidPlanError:
        return {"ratio": 0.0, "failed": True, "evaluations": planner.evaluations,
                "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    confidence = getattr(planner, "last_confidence", None)
    return {"ratio": reward(workload, plan), "failed": False, "evaluations": planner.evaluations, "wall_s": wall,
            "confidence": confidence.probability if confidence else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", help="policy file (default: the shipped one)")
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--n", type=int, default=HELDOUT_SIZE)
    parser.add_argument("--json", metavar="FILE", help="write per-workload results here")
    parser.add_argument("--family", choices=families(), help="held-out workloads of one zoo family only")
    args = parser.parse_args()
    console = Console()
    workloads = heldout_workloads(seed=args.seed, n=args.n, progress=True, family=args.family)
    reward = CostModelReward()
    methods = {"exhaustive": (get_planner("exhaustive"), 1),
               "rl greedy": (get_planner("rl", policy=args.policy, beam=1, refine=False), 1),
               "rl top-8": (get_planner("rl", policy=args.policy, refine=False), 8),
               "rl": (get_planner("rl", policy=args.policy), 1),
               "rules": (get_planner("rules"), 1)}
    results = {name: [run_planner(p, w, k, reward) for w in workloads] for name, (p, k) in methods.items()}

    table = Table(title=f"{len(workloads)} held-out workloads: ratio to the exhaustive oracle (cost model)")
    for column in ("method", "median", "p5", "min", "failed", "evaluations (median)", "wall s (median)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, rows in results.items():
        ratios = np.array([r["ratio"] for r in rows])
        table.add_row(name, f"{np.median(ratios):.4f}", f"{np.percentile(ratios, 5):.4f}", f"{ratios.min():.4f}",
                      str(sum(r["failed"] for r in rows)), f"{np.median([r['evaluations'] for r in rows]):,.0f}",
                      f"{np.median([r['wall_s'] for r in rows]):.3f}")
    console.print(table)
    rl, rules = np.array([r["ratio"] for r in results["rl greedy"]]), np.array([r["ratio"] for r in results["rules"]])
    console.print(f"rl greedy better than rules on {np.mean(rl > rules * (1 + TIE)):.0%} of workloads, at least as "
                  f"good on {np.mean(rl >= rules * (1 - TIE)):.0%} (rules found no plan on "
                  f"{sum(r['failed'] for r in results['rules'])})")
    confidence = np.array([r["confidence"] for r in results["rl greedy"]])
    unsure = confidence < np.median(confidence)
    console.print(f"rl greedy when the policy is less sure than its median ({np.median(confidence):.0%}): median ratio "
                  f"{np.median(rl[unsure]):.4f}, least {rl[unsure].min():.4f}; when surer: median "
                  f"{np.median(rl[~unsure]):.4f}, least {rl[~unsure].min():.4f}")
    if args.json:
        rows = [{"workload": w.describe(), **{name: results[name][i] for name in results}}
                for i, w in enumerate(workloads)]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
