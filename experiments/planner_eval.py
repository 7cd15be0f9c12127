"""Every planner on the held-out workloads, against the exhaustive oracle, under the cost model.

For each held-out workload (`autopar.envs.workloads.heldout_workloads`: every zoo family, preset
and precision of the registries, or one family with --family) and each planner: the ratio of
the predicted throughput of its plan to the oracle's best (oracle time / plan time; the best of
the k plans for rl top-8; 0 when it finds no plan), the cost-model evaluations it spent, and its
wall time. The rl rows: `rl` is what `autopar search` returns first (8 plans beam-decoded,
refined by coordinate descent, then degrees traded between axes with the policy completing each
new layout, ranked by the cost model), `rl-no-trades` the same without the trades, `rl-top8` the
8 decoded plans ranked without refinement, `rl-greedy` the policy alone (greedy decoding). Writes to --out:
results.json (per workload), table.md, and two figures (ratio distribution per planner; ratio
against evaluations). The oracle's answers are cached in --out/oracle.json, so a rerun pays only
for the planners. --readme FILE rewrites the table between FILE's planner-table markers.

    python experiments/planner_eval.py [--limit 8] [--planners optuna-50,rules] [--out DIR]
    python experiments/planner_eval.py --family moe --limit 32 --planners rl,rl-top8,rl-greedy
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from autopar.atomic import write_text_atomic
from autopar.cost import estimate
from autopar.envs.rewards import workload_key
from autopar.envs.workloads import HELDOUT_SEED, HELDOUT_SIZE, families, heldout_workloads
from autopar.errors import AutoparError, NoValidPlanError
from autopar.search import get_planner

PLANNERS = {  # name -> (registry name, options, k: the best of the top k counts)
    "rl": ("rl", {}, 1),
    "rl-no-trades": ("rl", {"trades": False}, 1),
    "rl-top8": ("rl", {"refine": False}, 8),
    "rl-greedy": ("rl", {"beam": 1, "refine": False}, 1),
    "optuna-50": ("optuna", {"trials": 50, "progress": False}, 1),
    "optuna-200": ("optuna", {"trials": 200, "progress": False}, 1),
    "rules": ("rules", {}, 1),
    "random-50": ("random", {"trials": 50}, 1),
    "random-200": ("random", {"trials": 200}, 1),
}
SEEDED = ("rl", "optuna", "random")
TIE = 1e-3  # ratios closer than this are the same plan quality


def make_planners(names: list[str], seed: int, policy: str | None, console: Console) -> dict:
    """name -> (planner, k); a planner that cannot be built (no trained policy yet) is skipped."""
    out = {}
    for name in names:
        kind, options, k = PLANNERS[name]
        options = {**options, **({"seed": seed} if kind in SEEDED else {}), **({"policy": policy} if kind == "rl" else {})}
        try:
            out[name] = get_planner(kind, **options), k
        except (AutoparError, ImportError) as e:
            console.print(f"[yellow]skipping {name}: {e}[/yellow]")
    return out


def oracle(workload, cache: dict) -> dict:
    """The exhaustive oracle's best time, with its evaluations, wall time and whether it proved its plan the
    space's optimum (`exact`, after `solved` outer plans solved per stage), cached by workload."""
    key = workload_key(workload)
    if key not in cache or "exact" not in cache[key]:  # (entries before exact was kept: asked again)
        planner, started = get_planner("exhaustive"), time.perf_counter()
        plan = planner.propose(workload, 1)[0]
        cache[key] = {"time_s": estimate(workload, plan).iteration_time_s, "plan": plan.describe(),
                      "evaluations": planner.evaluations, "wall_s": time.perf_counter() - started,
                      "non_uniform": bool(plan.stage_recompute or plan.layer_split), "pp": plan.pp,
                      "exact": bool(planner.exact), "solved": int(planner.solved)}
    return cache[key]


def per_stage_set(args, cache: dict, cache_path: Path, console: Console) -> list:
    """The held-out set with at least `args.per_stage` workloads whose best plan has pp >= 4 and is not
    uniform (issue 41's policy check): the standard set's such workloads, more of them from further
    draws of the same held-out stream (`--pool`), then the standard set's other workloads in order up
    to --limit. A stratified set, said as such: the standard one holds few (9 of 64)."""
    pool = heldout_workloads(seed=args.heldout_seed, n=args.pool, progress=True, family=args.family)
    staged, others = [], []
    for i, w in enumerate(track(pool, description="the oracle on the pool", console=console, transient=True)):
        best = oracle(w, cache)
        cache_path.write_text(json.dumps(cache, indent=1))
        if best["non_uniform"] and best["pp"] >= 4:
            staged.append(w)
        elif i < args.limit:
            others.append(w)
        if len(staged) >= args.per_stage and i >= args.limit - 1:
            break
    if len(staged) < args.per_stage:
        console.print(f"[yellow]only {len(staged)} of {len(pool)} pool workloads have a non-uniform best plan "
                      f"at pp >= 4 (wanted {args.per_stage}); raise --pool[/yellow]")
    return staged[:args.per_stage] + others[:args.limit - min(len(staged), args.per_stage)]


def run(planner, k: int, workload, oracle_time: float) -> dict:
    started = time.perf_counter()
    try:
        plans = planner.propose(workload, k)
    except NoValidPlanError:
        return {"ratio": 0.0, "plan": None, "evaluations": planner.evaluations,
                "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    times = [estimate(workload, p).iteration_time_s for p in plans]
    best = int(np.argmin(times))
    return {"ratio": oracle_time / times[best], "plan": plans[best].describe(), "evaluations": planner.evaluations,
            "wall_s": wall}


def summary(results: list[dict], names: list[str]) -> list[dict]:
    """Per planner (the oracle first): ratio median / p5 / min, failures, median evaluations and
    wall time, and the share of workloads where it beats the rules."""
    rules = np.array([r["planners"]["rules"]["ratio"] for r in results]) if "rules" in names else None
    rows = []
    for name in ["oracle"] + names:
        runs = [r["oracle"] if name == "oracle" else r["planners"][name] for r in results]
        ratio = np.array([1.0 if name == "oracle" else x["ratio"] for x in runs])
        rows.append({
            "planner": name, "median": np.median(ratio), "p5": np.percentile(ratio, 5), "min": ratio.min(),
            "failed": int((ratio == 0).sum()), "evaluations": np.median([x["evaluations"] for x in runs]),
            "wall_s": np.median([x["wall_s"] for x in runs]),
            "better_than_rules": None if rules is None or name == "rules" else np.mean(ratio > rules * (1 + TIE)),
        })
    return rows


COLUMNS = ("planner", "median", "p5", "min", "no plan", "evaluations", "wall s", "> rules")
README_COLUMNS = ("planner", "median", "p5", "min", "cost-model evaluations (median)", "wall s (median)")
README_NAMES = {  # planner -> its row in the README
    "rl": "rl (8 decoded, refined, degrees traded, ranked, finished per stage)",
    "rl-no-trades": "rl without degree trades (8 decoded, refined, ranked)", "rl-top8": "rl top-8 (decoded, ranked)",
    "rl-greedy": "rl greedy (the policy alone)", "optuna-50": "optuna, 50 trials", "optuna-200": "optuna, 200 trials",
    "random-50": "random, 50", "random-200": "random, 200", "rules": "rules",
    "oracle": "exact search (every uniform plan priced or bounded, the best finished by the per-stage solver)",
}
MARKERS = ("<!-- planner-table:begin", "<!-- planner-table:end -->")


def formatted(row: dict) -> list[str]:
    share = row["better_than_rules"]
    return [row["planner"], f"{row['median']:.3f}", f"{row['p5']:.3f}", f"{row['min']:.3f}", str(row["failed"]),
            f"{row['evaluations']:,.0f}", f"{row['wall_s']:.3f}", "" if share is None else f"{share:.0%}"]


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(formatted(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def readme_table(rows: list[dict], command: str, non_uniform: tuple[int, list[dict]] | None = None) -> str:
    """The README's planner table, with the command that wrote it: the oracle's row last (its wall time
    beside the planners'), then, given `non_uniform` (count, rows), the planners again on the workloads
    whose best plan is not uniform (a per-stage split or recompute)."""
    lines = [f"{MARKERS[0]} written by: {command} -->", "| " + " | ".join(README_COLUMNS) + " |",
             "|" + "---|" * len(README_COLUMNS)]

    def line(r: dict, suffix: str = "") -> str:
        return (f"| {README_NAMES.get(r['planner'], r['planner'])}{suffix} | {r['median']:.3f} | {r['p5']:.3f} "
                f"| {r['min']:.3f} | {r['evaluations']:,.0f} | {r['wall_s']:.2f} |")

    lines += [line(r) for r in rows if r["planner"] != "oracle"] + [line(r) for r in rows if r["planner"] == "oracle"]
    if non_uniform is not None and non_uniform[0]:
        n, subset = non_uniform
        lines += [line(r, f", on the {n} workloads with a non-uniform best plan")
                  for name in ("rl", "oracle") for r in subset if r["planner"] == name]
    return "\n".join(lines + [MARKERS[1]])


def _replay() -> list[str]:
    """This run's arguments without --out (where the caches went is not how the table was made)."""
    out, args = [], iter(sys.argv[1:])
    for a in args:
        if a == "--out":
            next(args, None)
        elif not a.startswith("--out="):
            out.append(a)
    return out


def rewrite_readme(path: Path, table: str) -> None:
    """Replace the table between the markers (both must be there: nothing else is touched)."""
    text = path.read_text()
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no planner table markers ({MARKERS[0]} ... {MARKERS[1]}); add them around "
                         f"the table to regenerate")
    write_text_atomic(path, text[:start] + table + text[end + len(MARKERS[1]):])


def figures(results: list[dict], names: list[str], rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [[r["planners"][n]["ratio"] for r in results] for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 4))
    ax.boxplot(ratios, showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=20)
    for i, values in enumerate(ratios, start=1):
        ax.scatter(i + np.random.default_rng(i).uniform(-0.15, 0.15, len(values)), values, s=8, alpha=0.5)
    ax.set_ylabel("predicted throughput / oracle's")
    ax.set_title(f"{len(results)} held-out workloads")
    fig.tight_layout()
    fig.savefig(out / "ratio_distribution.png", dpi=150)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in zip(names, rows[1:]):
        runs = [r["planners"][name] for r in results]
        dots = ax.scatter([max(x["evaluations"], 1) for x in runs], [x["ratio"] for x in runs], s=8, alpha=0.3)
        ax.scatter(max(row["evaluations"], 1), row["median"], s=60, color=dots.get_facecolor()[0][:3], edgecolor="black",
                   label=name)
    ax.scatter(rows[0]["evaluations"], 1.0, s=60, marker="*", color="black", label="oracle (median)")
    ax.set_xscale("log")
    ax.set_xlabel("cost-model evaluations per workload")
    ax.set_ylabel("predicted throughput / oracle's")
    ax.legend(fontsize=7, title="median (large) and workloads", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ratio_vs_evaluations.png", dpi=150)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/planner_eval"))
    parser.add_argument("--limit", type=int, default=HELDOUT_SIZE, metavar="N", help="first N held-out workloads")
    parser.add_argument("--planners", default=",".join(PLANNERS), help=f"comma-separated, of {list(PLANNERS)}")
    parser.add_argument("--heldout-seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--seed", type=int, default=0, help="seed of the rl, optuna and random planners")
    parser.add_argument("--policy", help="rl policy file (default: the shipped one)")
    parser.add_argument("--family", help=f"held-out workloads of one zoo family only, of {list(families())}")
    parser.add_argument("--per-stage", type=int, default=0, metavar="N",
                        help="a stratified set: N workloads whose best plan has pp >= 4 and is not uniform, the rest "
                             "of --limit from the standard set (draws past it from --pool)")
    parser.add_argument("--pool", type=int, default=4 * HELDOUT_SIZE, metavar="M",
                        help="with --per-stage: how many held-out draws to look through")
    parser.add_argument("--readme", type=Path, metavar="FILE", help="rewrite the planner table in FILE (README.md)")
    args = parser.parse_args()
    unknown = set(args.planners.split(",")) - set(PLANNERS)
    if unknown:
        parser.error(f"unknown planners {sorted(unknown)}; choose from {list(PLANNERS)}")
    if args.family is not None and args.family not in families():
        parser.error(f"unknown family {args.family!r}; choose from {list(families())}")
    console = Console()
    planners = make_planners(args.planners.split(","), args.seed, args.policy, console)
    names = list(planners)
    args.out.mkdir(parents=True, exist_ok=True)
    cache_path = args.out / "oracle.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}

    workloads = (per_stage_set(args, cache, cache_path, console) if args.per_stage else
                 heldout_workloads(seed=args.heldout_seed, n=args.limit, progress=True, family=args.family))
    results = []
    for w in track(workloads, description="planning", console=console, transient=True):
        best = oracle(w, cache)
        cache_path.write_text(json.dumps(cache, indent=1))
        results.append({"workload": w.describe(), "oracle": best,
                        "planners": {name: run(p, k, w, best["time_s"]) for name, (p, k) in planners.items()}})
    (args.out / "results.json").write_text(json.dumps(results, indent=1))

    rows = summary(results, names)
    stratified = f" ({args.per_stage} with a non-uniform best plan at pp >= 4)" if args.per_stage else ""
    title = (f"{len(results)}{stratified} held-out {args.family + ' ' if args.family else ''}workloads (seed {args.heldout_seed}), planner seed {args.seed}: ratio of "
             f"predicted throughput to the oracle's (median, p5, min); median evaluations and wall time; "
             f"share of workloads where the planner beats the rules")
    table = Table(title=title)
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "planner" else "right")
    for row in rows:
        table.add_row(*formatted(row))
    console.print(table)
    (args.out / "table.md").write_text(markdown(rows, title))
    figures(results, names, rows, args.out)
    if args.readme:
        staged = [r for r in results if r["oracle"].get("non_uniform")]
        subset = (len(staged), summary(staged, names)) if staged else None
        rewrite_readme(args.readme, readme_table(rows, "python experiments/planner_eval.py " + shlex.join(_replay()),
                                                 subset))
        console.print(f"planner table in {args.readme} rewritten")
    console.print(f"results, table.md and figures in {args.out}")


if __name__ == "__main__":
    main()
