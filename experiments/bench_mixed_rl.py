"""The rl planner on held-out mixed workloads against the exact mixed search (issue 42, acceptance 2).

The 32 workloads are drawn with a fixed seed (`--seed`): each takes a held-out homogeneous draw
(`autopar.envs.workloads.sample_heldout_spec`: a model shape off the zoo's proportions, which no policy
trains on, and its precision) and puts it on a mixed cluster of 2-3 distinct GPU presets (training and
held-out presets; not gb200-nvl72's 72-GPU node nor the published runs' machines), 1-2 whole nodes each,
with a global batch of 1/2 to 8 samples per GPU (16 to 512); a draw whose precision a group cannot run,
whose training state exceeds the cluster's memory, or which fits no plan is skipped. For each workload it
prints the exact search's plan quality and time (run once: its answers are cached in --out/exact.json, a
rerun pays for rl only) and rl's, timed `--repeats` times: the medians of the wall and of the process's
CPU seconds (the CPU time stands for a machine of its own when the 2 cores are shared), and the ratio of
rl's predicted tokens/s to the exact search's (acceptance 2: median >= 0.995, min >= 0.97; rl <= 2 s).
Then a change of mix (`changed`: the first group loses a node where it has two, else the last group
leaves) and `replan_mixed` of rl's plan for it, timed the same way (acceptance 2: <= 10 s).

    python experiments/bench_mixed_rl.py [--count 32] [--repeats 3] [--limit N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.atomic import write_text_atomic
from autopar.cluster import PRESETS, load_cluster
from autopar.cluster.mixed import mixed_cluster
from autopar.envs.workloads import HELDOUT_CLUSTERS, TRAIN_CLUSTERS, _precisions, sample_heldout_spec
from autopar.errors import AutoparError, NoValidPlanError
from autopar.knobs import STATE_BYTES_PER_PARAM, storage_dtype
from autopar.mixed.replan import replan_mixed
from autopar.mixed.search import search_mixed
from autopar.mixed.workload import MixedWorkload
from autopar.profile import profile_model
from autopar.workload import Workload

SEED = 20_261_207
COUNT = 32
PRESETS_MIXED = tuple(p for p in TRAIN_CLUSTERS + HELDOUT_CLUSTERS if PRESETS[p]["gpus_per_node"] <= 8)
NODES = (1, 2)


def draw(rng: np.random.Generator) -> dict | None:
    """One mixed workload as data (None: a draw to skip)."""
    spec = sample_heldout_spec(rng)
    if spec is None:
        return None
    count = 3 if rng.random() < 1 / 3 else 2
    presets = [str(p) for p in rng.choice(PRESETS_MIXED, size=count, replace=False)]
    nodes = [int(rng.choice(NODES)) for _ in presets]
    if any(spec.precision not in _precisions(p) for p in presets):
        return None
    gpus = sum(n * PRESETS[p]["gpus_per_node"] for p, n in zip(presets, nodes))
    batch = int(min(512, max(16, gpus * 2.0 ** rng.integers(-1, 4))))
    return {"model": spec.model, "model_args": dict(spec.model_args), "precision": spec.precision,
            "cluster": ",".join(f"{p}:{n}" for p, n in zip(presets, nodes)), "global_batch": batch}


def build(w: dict) -> MixedWorkload:
    """The workload (a Workload where the cluster names one group: what a change of mix may leave)."""
    profile = profile_model(w["model"], w["model_args"], dtype=storage_dtype(w["precision"]))
    groups = [load_cluster(p, nodes=int(n)) for p, n in (part.split(":") for part in w["cluster"].split(","))]
    if len(groups) == 1:
        return Workload(profile, groups[0], w["global_batch"], fp8=w["precision"] == "fp8")
    return MixedWorkload(profile, mixed_cluster(groups), w["global_batch"], fp8=w["precision"] == "fp8")


def changed(w: dict) -> dict:
    """The change of mix re-planned for: the first group loses a node where it has two, else the last leaves."""
    parts = [part.split(":") for part in w["cluster"].split(",")]
    parts = [[parts[0][0], "1"], *parts[1:]] if parts[0][1] == "2" else parts[:-1]
    return {**w, "cluster": ",".join(f"{p}:{n}" for p, n in parts)}


def timed_replan(old, mw, repeats: int) -> dict:
    """Medians of `repeats` re-plans of `old` for `mw` (wall and CPU seconds), and the decision."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        decided, _ = replan_mixed(old, mw)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "decision": decided.decision}


def fits_memory(mw: MixedWorkload) -> bool:
    """The training state fits the cluster's summed memory (else no plan can: not worth an exact search)."""
    memory = sum(g.num_gpus * g.gpu.memory_bytes for g in mw.cluster.groups)
    return mw.profile.params * STATE_BYTES_PER_PARAM <= memory


def timed(mw, method: str, repeats: int) -> dict:
    """Medians of `repeats` runs of `search_mixed` (wall and this process's CPU seconds), and the plan."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = search_mixed(mw, method)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"tokens_per_s": result.estimate.tokens_per_s, "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus), "exact": result.exact, "plan": result.plan.describe(),
            "result": result}


def workloads(count: int, seed: int, cache: dict, save, console: Console):
    """The first `count` feasible draws of the stream, with the exact search's answer (cached by key)."""
    rng, seen, found = np.random.default_rng(seed), set(), 0
    for _ in range(50 * count):
        if found == count:
            return
        try:
            w = draw(rng)
            if w is None or json.dumps(w, sort_keys=True) in seen:
                continue
            seen.add(json.dumps(w, sort_keys=True))
            mw = build(w)
        except (AutoparError, ValueError):
            continue
        if not fits_memory(mw):
            continue
        key = json.dumps(w, sort_keys=True)
        if key not in cache:
            try:
                cache[key] = {k: v for k, v in timed(mw, "exhaustive", 1).items() if k != "result"}
            except NoValidPlanError:
                cache[key] = None
            save()
            console.print(f"exact: {mw.describe()}: {cache[key]}", soft_wrap=True, markup=False)
        if cache[key] is None:
            continue
        found += 1
        yield w, mw, cache[key]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--limit", type=int, help="time rl on the first N only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--method", default="rl", help="the mixed method timed against the exact search")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/bench_mixed_rl"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "exact.json"
    cache = json.loads(path.read_text()) if path.exists() else {}

    def save():
        write_text_atomic(path, json.dumps(cache, indent=1, sort_keys=True))

    table = Table(title=f"{args.method} against the exact mixed search, medians of {args.repeats}")
    for column in ("#", "workload", "exact tok/s", "exact s", f"{args.method} / exact", f"{args.method} s",
                   f"{args.method} cpu s", "changed to", "re-plan", "re-plan s", "re-plan cpu s"):
        table.add_column(column)
    rows = []
    for i, (w, mw, exact) in enumerate(workloads(args.count, args.seed, cache, save, console), 1):
        if args.limit and i > args.limit:
            break
        got = timed(mw, args.method, args.repeats)
        old = got.pop("result").plan
        ratio = got["tokens_per_s"] / exact["tokens_per_s"]
        new = changed(w)
        try:
            replan = {"cluster": new["cluster"], **timed_replan(old, build(new), args.repeats)}
        except NoValidPlanError:
            replan = {"cluster": new["cluster"], "wall_s": None, "cpu_s": None, "decision": "no plan"}
        rows.append({"workload": w, "exact": exact, args.method: got, "ratio": ratio, "replan": replan})
        table.add_row(str(i), mw.describe(), f"{exact['tokens_per_s']:,.0f}", f"{exact['wall_s']:.1f}",
                      f"{ratio:.4f}", f"{got['wall_s']:.2f}", f"{got['cpu_s']:.2f}", replan["cluster"],
                      replan["decision"], "" if replan["wall_s"] is None else f"{replan['wall_s']:.2f}",
                      "" if replan["cpu_s"] is None else f"{replan['cpu_s']:.2f}")
        if ratio < 0.995:
            console.print(f"#{i} exact: {exact['plan']}\n#{i} {args.method}: {got['plan']}", soft_wrap=True,
                          markup=False)
    console.print(table)
    ratios = [r["ratio"] for r in rows]
    walls = [r[args.method]["wall_s"] for r in rows]
    cpus = [r[args.method]["cpu_s"] for r in rows]
    exact_walls = [r["exact"]["wall_s"] for r in rows]
    replans = [r["replan"]["wall_s"] for r in rows if r["replan"]["wall_s"] is not None]
    replan_cpus = [r["replan"]["cpu_s"] for r in rows if r["replan"]["cpu_s"] is not None]
    console.print(f"{len(rows)} workloads: {args.method}/exact median {statistics.median(ratios):.4f}, min "
                  f"{min(ratios):.4f}; {args.method} wall median {statistics.median(walls):.2f} s (max "
                  f"{max(walls):.2f}), cpu median {statistics.median(cpus):.2f} s (max {max(cpus):.2f}); exact wall "
                  f"median {statistics.median(exact_walls):.1f} s (max {max(exact_walls):.1f}); re-plan wall median "
                  f"{statistics.median(replans):.2f} s (max {max(replans):.2f}), cpu median "
                  f"{statistics.median(replan_cpus):.2f} s (max {max(replan_cpus):.2f}) on {len(replans)}", markup=False)
    write_text_atomic(args.out / f"{args.method}.json", json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
