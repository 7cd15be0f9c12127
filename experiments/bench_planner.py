"""Planner speed benchmark (issue 2, acceptance 4). Prints medians of 5 runs:

- profile time of the 175B GPT model.py (meta device, no cache), in a warm process and in a
  fresh one (the fresh one pays torch's import);
- `autopar search` wall time end to end for 175B on 1024 GPUs (128 x dgx-a100-80g, global batch
  1536), as a subprocess, with the profile cached and with an empty cache;
- cost-model plans evaluated per second over that workload's whole plan space.

    python experiments/bench_planner.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

GPT = Path(__file__).resolve().parent.parent / "autopar" / "zoo" / "gpt.py"
ARGS = {"size": "175b"}
SEARCH = ["search", str(GPT), "--model-arg", "size=175b", "--nodes", "128", "--global-batch", "1536", "--json"]


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def fresh_process_profile() -> None:
    code = ("from autopar.profile import profile_model; "
            f"profile_model({str(GPT)!r}, {ARGS!r}, cache=False)")
    subprocess.run([sys.executable, "-c", code], check=True)


def cli(env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "autopar", *SEARCH], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    n = parser.parse_args().repeats

    from autopar.cluster import load_cluster
    from autopar.cost import evaluate
    from autopar.profile import profile_model
    from autopar.search.exhaustive import CHUNK
    from autopar.search.space import enumerate_plans
    from autopar.workload import Workload

    rows = []
    profile_model(GPT, ARGS, cache=False)  # torch's first-use imports
    rows.append(("profile 175B GPT, warm process", timed(lambda: profile_model(GPT, ARGS, cache=False), n), "≤ 3 s"))
    rows.append(("profile 175B GPT, fresh process", timed(fresh_process_profile, n), "≤ 3 s"))
    cli()  # fills the profile cache
    rows.append(("search 175B on 1024 GPUs, cached profile", timed(cli, n), "≤ 5 s"))
    cold = []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as d:
            cold += timed(lambda: cli({"AUTOPAR_CACHE_DIR": d}), 1)
    rows.append(("search 175B on 1024 GPUs, empty cache", cold, "≤ 5 s"))

    w = Workload(profile_model(GPT, ARGS), load_cluster("dgx-a100-80g", nodes=128), 1536)
    space = enumerate_plans(w)
    chunks = [space.take(np.arange(s, min(s + CHUNK, len(space)))) for s in range(0, len(space), CHUNK)]
    rates = [len(space) / t for t in timed(lambda: [evaluate(w, c) for c in chunks], n)]

    table = Table(title=f"autopar planner benchmark, median of {n} ({os.cpu_count()} CPUs)")
    for col in ("measure", "median", "min", "max", "target"):
        table.add_column(col)
    for name, times, target in rows:
        table.add_row(name, f"{statistics.median(times):.2f} s", f"{min(times):.2f} s", f"{max(times):.2f} s", target)
    table.add_row(f"cost model, {len(space):,} plans", f"{statistics.median(rates):,.0f} plans/s",
                  f"{min(rates):,.0f}", f"{max(rates):,.0f}", "≥ 100,000 plans/s")
    Console().print(table)


if __name__ == "__main__":
    main()
