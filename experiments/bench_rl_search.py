"""Wall time of `autopar search --method rl` end to end for a 7B model on 64 GPUs.

Runs the command as a user would (a fresh Python process each time, profile cache warm after a
first run), five times, and prints the median wall time and the cost-model evaluations it made.

    python experiments/bench_rl_search.py [--runs 5] [--policy policy.zip]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMAND = [sys.executable, "-m", "autopar", "search", "llama", "--model-arg", "size=llama2-7b",
           "--cluster", "dgx-a100-80g", "--nodes", "8", "--global-batch", "512", "--method", "rl", "--json"]


def run_once(extra: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run(COMMAND + extra, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--policy", help="policy file (default: the shipped one)")
    args = parser.parse_args()
    extra = ["--policy", args.policy] if args.policy else []
    run_once(extra)  # warm the profile cache, as a user's second search would find it
    walls, out = [], {}
    for _ in range(args.runs):
        wall, out = run_once(extra)
        walls.append(wall)
    print(f"autopar search --method rl, llama2-7b on 8 x 8 A100-80GB, global batch 512: "
          f"median wall {statistics.median(walls):.2f} s over {args.runs} runs "
          f"(min {min(walls):.2f}, max {max(walls):.2f}); {out['cost_model_evaluations']:,} cost-model "
          f"evaluations; plan {out['plan']['dp']}x{out['plan']['tp']}x{out['plan']['pp']} (dp x tp x pp), "
          f"{out['estimate']['tflops_per_gpu']:.0f} TFLOP/s per GPU")


if __name__ == "__main__":
    main()
