"""Why a plan: for each knob, what the best plan differing only in that knob would cost.

A reason an engineer can check: "pp=8: the best other pipeline depth (pp=4) is 18% slower",
"recompute 3 blocks: none fits without recompute (94 GB > 80 GB)". Works for any planner's
plan, since it only evaluates single-knob neighbours with the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost import PlanArrays, evaluate
from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.search.simplicity import TIE, simplicity_key
from autopar.search.space import (BUCKETS_MB, degree_choices, micro_batch_choices, recompute_choices,
                                  schedule_choices)


@dataclass(frozen=True)
class Reason:
    knob: str
    chosen: str
    text: str  # what the best alternative would cost


def _variants(workload, plan: Plan) -> dict[str, list[tuple[str, Plan]]]:
    batch = workload.global_batch
    out: dict[str, list] = {"degrees": [], "micro-batch": [], "zero": [], "recompute": [], "schedule": [],
                            "sequence parallel": [], "bucket": []}
    for dp, tp, pp in degree_choices(workload):
        if (dp, tp, pp) != (plan.dp, plan.tp, plan.pp):
            mbs = max(m for m in micro_batch_choices(workload, dp) if m <= plan.micro_batch_size)
            nmb = batch // (dp * mbs)
            sched = plan.schedule if pp > 1 else "1f1b"
            if sched == "interleaved":
                sched = "1f1b"
            rc = recompute_choices(workload, pp, 1)
            keep = plan.recompute_blocks if plan.recompute != "full" else \
                min(plan.recompute_blocks, max(n for mode, n in rc))
            out["degrees"].append((f"dp{dp} tp{tp} pp{pp}", dict(
                dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb, schedule=sched,
                virtual_stages=1, sequence_parallel=plan.sequence_parallel and tp > 1,
                zero=plan.zero if dp > 1 else 0, offload_optimizer=plan.offload_optimizer and dp > 1,
                recompute_blocks=keep, layer_split=())))
    for mbs in micro_batch_choices(workload, plan.dp):
        if mbs != plan.micro_batch_size:
            out["micro-batch"].append((f"micro-batch {mbs}x{batch // (plan.dp * mbs)}", dict(
                micro_batch_size=mbs, num_micro_batches=batch // (plan.dp * mbs))))
    if plan.dp > 1:
        out["zero"] = [(_zero_label(z), dict(zero=z, offload_optimizer=plan.offload_optimizer and z >= 2))
                       for z in (0, 1, 2, 3) if z != plan.zero]
        if plan.zero <= 1:
            out["bucket"] = [(f"{b:g} MB buckets", dict(bucket_mb=b)) for b in BUCKETS_MB if b != plan.bucket_mb]
    out["recompute"] = [(_recompute_label(m, n), dict(recompute=m, recompute_blocks=n))
                        for m, n in recompute_choices(workload, plan.pp, plan.virtual_stages)
                        if (m, n) != (plan.recompute, plan.recompute_blocks)]
    out["schedule"] = [(s if v == 1 else f"interleaved:{v}", dict(schedule=s, virtual_stages=v, layer_split=()))
                       for s, v in schedule_choices(workload, plan.pp, plan.num_micro_batches)
                       if (s, v) != (plan.schedule, plan.virtual_stages)]
    if plan.tp > 1:
        out["sequence parallel"] = [("sequence parallel " + ("off" if plan.sequence_parallel else "on"),
                                     dict(sequence_parallel=not plan.sequence_parallel))]
    plans: dict[str, list[tuple[str, Plan]]] = {}
    for knob, changes in out.items():
        for label, change in changes:
            try:
                candidate = plan.with_(**change)
                candidate.validate(workload)
            except PlanError:
                continue
            plans.setdefault(knob, []).append((label, candidate))
    return plans


def _zero_label(stage: int) -> str:
    return "DDP (ZeRO-0)" if stage == 0 else f"ZeRO-{stage}"


def _recompute_label(mode: str, blocks: int) -> str:
    return {"none": "no recompute", "selective": "selective recompute"}.get(mode, f"full recompute of {blocks} blocks")


def _chosen(plan: Plan, knob: str) -> str:
    return {
        "degrees": f"dp{plan.dp} tp{plan.tp} pp{plan.pp}",
        "micro-batch": f"micro-batch {plan.micro_batching}",
        "zero": _zero_label(plan.zero),
        "recompute": _recompute_label(plan.recompute, plan.recompute_blocks),
        "schedule": plan.schedule if plan.virtual_stages == 1 else f"interleaved:{plan.virtual_stages}",
        "sequence parallel": "sequence parallel " + ("on" if plan.sequence_parallel else "off"),
        "bucket": f"{plan.bucket_mb:g} MB buckets",
    }[knob]


def explain(workload, plan: Plan, coeffs=None) -> list[Reason]:
    variants = _variants(workload, plan)
    flat = [(knob, label, p) for knob, items in variants.items() for label, p in items]
    pa = PlanArrays.from_plans([plan] + [p for _, _, p in flat], workload.profile)
    res = evaluate(workload, pa, coeffs)
    base = res["iteration_time"][0]
    memory = workload.memory_budget
    reasons = []
    for knob in variants:
        rows = [i + 1 for i, (k, _, _) in enumerate(flat) if k == knob]
        fit = [i for i in rows if res["fits"][i]]
        if fit:
            i = min(fit, key=lambda j: res["iteration_time"][j])
            ratio = res["iteration_time"][i] / base
            if ratio > 1.0005:
                text = f"the best alternative, {flat[i - 1][1]}, is {ratio - 1:.1%} slower"
            elif ratio >= 1 / (1 + TIE):
                simpler = simplicity_key(plan) <= simplicity_key(flat[i - 1][2])
                text = (f"{flat[i - 1][1]} is as fast ({ratio - 1:+.1%}, within the {TIE:.1%} tie tolerance)"
                        + ("; the simpler plan is kept" if simpler else ""))
            else:
                text = f"{flat[i - 1][1]} is {1 - ratio:.1%} faster"
            if len(fit) < len(rows):
                text += f"; {len(rows) - len(fit)} other choice(s) do not fit in memory"
        else:
            i = min(rows, key=lambda j: res["peak_memory"][j])
            text = (f"no other choice fits in memory: the leanest, {flat[i - 1][1]}, needs "
                    f"{res['peak_memory'][i] / 1e9:.1f} GB > {memory / 1e9:.1f} GB usable")
        reasons.append(Reason(knob, _chosen(plan, knob), text))
    return reasons + _excluded(workload.profile)


def _excluded(profile) -> list[Reason]:
    """What the plan space leaves out for this model, and why (capability.model_limits)."""
    labels = {"pp": ("degrees", "pp > 1"), "sp": ("sequence parallel", "sequence parallel on"),
              "sp_off": ("sequence parallel", "sequence parallel off")}
    return [Reason(labels[k][0], "-", f"{labels[k][1]} not considered: {why}")
            for k, why in profile.limits.items() if k in labels]


def bottleneck(breakdown: dict[str, float]) -> str:
    """The largest non-compute share of the iteration, in words."""
    total = sum(breakdown.values())
    parts = {k: v for k, v in breakdown.items() if k != "compute" and v > 0}
    name = max(parts, key=parts.get) if parts else None
    if total <= 0 or name is None or parts[name] < 0.01 * total:
        return f"compute-bound, {breakdown.get('compute', 0) / max(total, 1e-30):.0%} of the iteration is compute"
    return f"{name.replace('_', ' ')} takes {parts[name] / total:.0%} of the iteration"

