"""Measured-reward fine-tuning against every plan of a restricted space measured once.

On this machine (gloo processes), for a small GPT on one node of --gpus-per-node ranks:

1. the restricted plan space (`autopar.envs.restricted.RestrictedSpace`, the defaults of
   `autopar train measured` unless --restrict says otherwise; at most 100 plans);
2. the reference: every plan of it run once as `autopar run` runs it (`MeasuredReward`, with an
   on-disk cache, so a rerun or the fine-tuning below repeats no run);
3. the cost model's view: its best plan of the space, and the shipped policy's greedy plan
   (the cost-model-only policy's pick), each with its measured time;
4. measured-reward fine-tuning from the shipped policy with --budget distinct measured plans
   (`autopar.policies.measured.finetune`, what `autopar train measured` runs), its pick
   and measured time. The fine-tuning measures with its own cache (OUT/loop_cache.json), so every
   plan it uses is run again inside the loop, not read from the reference; its pick is compared
   with the reference's best by the reference's measurement of it (one campaign, one noise).
   --loop-from-reference reads the reference's cache instead (fast, for repeated seeds).
5. with --confirm R: the pick and the reference's --top fastest plans run again R times, round by
   round, in one window of time, and their medians are compared: on a shared machine the speed
   drifts between the reference sweep and the loop by more than the gaps among the best plans.

Writes --out/reference.json and --out/summary.json and prints the table.

    python experiments/measured_reward_eval.py [--budget 40] [--steps 10] [--reference-only] [--out DIR]

(--steps, --warmup and --timeout: the run options of `autopar run`, autopar/executor/options.py.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.executor.options import RunOptions, add_run_flags

ROOT = Path(__file__).resolve().parent
MODEL_ARGS = ["size=tiny", "hidden=128", "seq_len=64"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--model-arg", action="append", default=None, metavar="KEY=VALUE")
    p.add_argument("--cluster", default="cpu")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    add_run_flags(p, ("steps", "warmup", "timeout_s"))
    p.add_argument("--budget", type=int, default=40)
    p.add_argument("--restrict", action="append", default=[], metavar="KNOB=VALUES")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="also repeat the fine-tuning with seeds SEED+1 ... SEED+N-1 (from the cache) and count the "
                        "picks within 5%% of the measured best")
    p.add_argument("--out", default=str(ROOT / "results" / "measured_reward"))
    p.add_argument("--cache", default=None, help="measurement cache (default OUT/cache.json)")
    p.add_argument("--reference-only", action="store_true", help="measure the space and stop")
    p.add_argument("--confirm", type=int, default=0, metavar="R",
                   help="run the pick and the reference's fastest plans R more times each, side by side")
    p.add_argument("--top", type=int, default=4, help="reference plans in the confirmation (default 4)")
    p.add_argument("--loop-from-reference", action="store_true",
                   help="the fine-tuning reads the reference's measurements instead of running its own")
    args = p.parse_args(argv)

    from autopar.cli.common import parse_model_args
    from autopar.cli.train import parse_restrictions
    from autopar.cost import estimate
    from autopar.envs.restricted import RestrictedSpace
    from autopar.policies.measured import MeasuredConfig, finetune, measured_workload
    from autopar.traces.reward import MeasuredReward

    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = parse_model_args(args.model_arg if args.model_arg is not None else MODEL_ARGS, None)
    workload = measured_workload(args.model, model_args, args.cluster, args.gpus_per_node, args.global_batch)
    space = RestrictedSpace(workload, parse_restrictions(args.restrict))
    console.print(f"{workload.describe()}: restricted space of {len(space.prefixes)} plans; varying "
                  f"{space.varying()}; fixed {space.fixed()}", soft_wrap=True)
    options = replace(RunOptions.from_args(args), backend="gloo", nproc_per_node=workload.world_size)
    backend = MeasuredReward(args.model, model_args, options, cache_path=args.cache or out / "cache.json",
                             cluster=args.cluster)

    started = time.perf_counter()
    reference = measure_all(space, backend, say=lambda m: console.print(m, soft_wrap=True))
    (out / "reference.json").write_text(json.dumps(reference, indent=1))
    console.print(f"reference: {len(reference)} plans in {time.perf_counter() - started:.0f} s")
    if args.reference_only:
        return 0

    by_plan = {r["describe"]: r["measured_s"] for r in reference}
    ok = [r for r in reference if r["measured_s"] is not None]
    best = min(ok, key=lambda r: r["measured_s"])
    predicted = [estimate(workload, plan).iteration_time_s for plan in space.plans]
    cm_best = space.plans[int(np.argmin(predicted))].describe()

    from sb3_contrib import MaskablePPO

    from autopar.policies.load import default_policy_path

    loop = backend if args.loop_from_reference else MeasuredReward(
        args.model, model_args, options, cache_path=out / "loop_cache.json", cluster=args.cluster)
    model = MaskablePPO.load(default_policy_path(), device="cpu")
    summary = finetune(model, space, loop, MeasuredConfig(budget=args.budget, seed=args.seed),
                       say=lambda m: console.print(m, soft_wrap=True))
    for entry in (summary["pick"], summary["prior_pick"]):  # the reference's measurement of it
        entry["loop_measured_s"], entry["measured_s"] = entry["measured_s"], by_plan.get(entry["describe"])
    summary["reference"] = {"plans": len(reference), "failed": len(reference) - len(ok), "best": best,
                            "cost_model_best": {"describe": cm_best, "measured_s": by_plan.get(cm_best)},
                            "spearman_predicted_vs_measured": _spearman(
                                [predicted[i] for i, r in enumerate(reference) if r["measured_s"] is not None],
                                [r["measured_s"] for r in ok])}
    summary["workload"] = workload.describe()
    repeats = []
    for seed in range(args.seed + 1, args.seed + args.seeds):
        again = finetune(MaskablePPO.load(default_policy_path(), device="cpu"), space, loop,
                         MeasuredConfig(budget=args.budget, seed=seed))
        again["pick"]["measured_s"] = by_plan.get(again["pick"]["describe"])
        repeats.append({"seed": seed, "pick": again["pick"]["describe"], "measured_s": again["pick"]["measured_s"],
                        "ratio": again["pick"]["measured_s"] / best["measured_s"], "budget_used": again["budget_used"],
                        "best_found_at": again["best_found_at"], "source": again["pick"]["source"]})
    summary["repeats"] = repeats
    if args.confirm:
        fastest = [r["describe"] for r in sorted(ok, key=lambda r: r["measured_s"])[:args.top]]
        summary["confirmation"] = _confirm(space, backend, fastest, summary["pick"]["describe"], args.confirm)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    t = Table(title=f"measured-reward fine-tuning: {workload.describe()}; {len(reference)} plans, varying "
                    + ", ".join(f"{k} {{{'/'.join(v)}}}" for k, v in space.varying().items()))
    for col in ("", "plan", "measured step (s)", "over the measured best"):
        t.add_column(col)
    rows = [("measured best (all plans run once)", best["describe"], best["measured_s"]),
            ("cost model's best of the space", cm_best, by_plan.get(cm_best)),
            ("shipped policy (cost-model prior), greedy", summary["prior_pick"]["describe"],
             summary["prior_pick"]["measured_s"]),
            (f"fine-tuned on measured rewards ({summary['budget_used']}/{args.budget} budget)",
             summary["pick"]["describe"], summary["pick"]["measured_s"])]
    for name, plan, s in rows:
        t.add_row(name, plan, f"{s:.4f}" if s is not None else "-",
                  f"{s / best['measured_s']:.3f}" if s is not None else "-")
    console.print(t)
    console.print(f"the fine-tuned pick was first measured as plan {summary['best_found_at']} of "
                  f"{summary['budget_used']} (proposed by: {summary['pick']['source']}); measured plans by source: "
                  f"{_count(summary['measurements'])}", soft_wrap=True)
    if repeats:
        first = {"ratio": summary["pick"]["measured_s"] / best["measured_s"]}
        within = sum(r["ratio"] <= 1.05 for r in [*repeats, first])
        console.print(f"seeds {args.seed}..{args.seed + args.seeds - 1}: {within}/{args.seeds} picks within 5% of the "
                      f"measured best; ratios {[round(r['ratio'], 3) for r in repeats]}; best found at "
                      f"{[r['best_found_at'] for r in repeats]} (by {[r['source'] for r in repeats]}); uniform random "
                      f"search of {args.budget} distinct plans contains the best with probability "
                      f"{min(1.0, args.budget / len(reference)):.2f}", soft_wrap=True)
    cache = "the reference's cache" if args.loop_from_reference else "the loop's cache (earlier runs)"
    if args.confirm:
        c = summary["confirmation"]
        console.print(f"side by side, {args.confirm} runs each (median s): "
                      + ", ".join(f"{k} {v['median_s']:.4f}" for k, v in c["plans"].items())
                      + f"; the pick over the fastest: {c['pick_ratio']:.3f}", soft_wrap=True)
    console.print(f"budget used: {summary['budget_used']} distinct plans measured ({summary['runs_now']} run now, "
                  f"{summary['from_cache']} from {cache}), {len(summary['rounds'])} rounds; the pick measured "
                  f"{summary['pick']['loop_measured_s']} s inside the loop; fixed knobs: {space.fixed()}",
                  soft_wrap=True)
    return 0


def measure_all(space, backend, say=lambda msg: None) -> list[dict]:
    """Every plan of the space measured once (the reference; the backend's cache keeps them)."""
    out = []
    for i, (prefix, plan) in enumerate(zip(space.prefixes, space.plans), start=1):
        started = time.perf_counter()
        res = backend(plan)
        record = res.get("record") or {}
        out.append({"plan": plan.to_dict(), "describe": plan.describe(), "reward": float(res["reward"]),
                    "measured_s": -float(res["reward"]) if record.get("outcome", "ok") == "ok" and res["reward"] > -1e3
                    else None, "outcome": record.get("outcome", "ok"), "cached": bool(res.get("cached"))})
        say(f"reference {i}/{len(space.prefixes)}: {plan.describe()}: "
            f"{out[-1]['measured_s'] if out[-1]['measured_s'] is not None else out[-1]['outcome']}"
            f"{' (cached)' if res.get('cached') else ''} [{time.perf_counter() - started:.1f} s]")
    return out


def _confirm(space, backend, top: list[str], pick: str, repeats: int) -> dict:
    """Run the plans (the reference's fastest and the pick) `repeats` times, round by round."""
    plans = {p.describe(): p for p in space.plans}
    names = list(dict.fromkeys(top + [pick]))
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            record = backend.run(plans[name])["record"] or {}
            if record.get("outcome") == "ok":
                times[name].append(record["measured"]["median_step_s"])
    medians = {n: float(np.median(t)) for n, t in times.items() if t}
    return {"plans": {n: {"median_s": medians[n], "runs_s": times[n]} for n in medians},
            "pick": pick, "pick_ratio": medians[pick] / min(medians.values())}


def _count(measurements: list) -> dict:
    out: dict = {}
    for m in measurements:
        out[m["source"]] = out.get(m["source"], 0) + 1
    return out


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


if __name__ == "__main__":
    sys.exit(main())
