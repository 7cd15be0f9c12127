"""Why a plan: for each knob, what the best plan differing only in that knob would cost.

A reason an engineer can check: "pp=8: the best other pipeline depth (pp=4) is 18% slower",
"recompute 3 blocks: none fits without recompute (94 GB > 80 GB)". Works for any planner's
plan, since it only evaluates single-knob neighbours with the cost model. The rows are the
registry's: one for the degrees of every axis together, one per other decision knob with an
alternative (`autopar.knobs`); a neighbour keeps every other knob, moving a later one to its
nearest valid choice only where the change leaves it invalid.
"""

from __future__ import annotations

import re

from dataclasses import dataclass

import numpy as np

from autopar import axes, capability
from autopar.cost import PlanArrays, evaluate
from autopar.cost.model import time_parts
from autopar.errors import PlanError
from autopar.knobs import Knob, decisions, depends_of, knobs
from autopar.plan import Plan, degrees_text
from autopar.search.simplicity import TIE, simplicity_key
from autopar.search.space import choices, degree_choices, plan_of, values_of

DEGREES = "degrees"  # the row of every axis at once: a degree moves only with another
PER_STAGE = "stage_recompute"  # kept in every neighbour with the same stages (autopar/stage_table.py has its row)


@dataclass(frozen=True)
class Reason:
    knob: str
    chosen: str
    text: str  # what the best alternative would cost


def _complete(workload, plan: Plan, values: dict, changed: str) -> Plan:
    """The plan with `values`, its knobs from `changed` on moved to the nearest valid choice
    where the change left their value invalid (a smaller micro-batch under more data
    parallelism, 1F1B where interleaving no longer divides, fewer recomputed blocks)."""
    out: dict = {}
    started = False
    for k in knobs():
        started = started or k.name == changed or (changed == DEGREES and k.name in axes.AXES)
        value = values[k.name]
        if started and not (k.name in axes.AXES and changed == DEGREES) and k.name != PER_STAGE:
            opts = choices(workload, k, out)
            if value not in opts:
                value = opts[_nearest(k, value, opts)]
        out[k.name] = value
    same_stages = (out["pp"], out["schedule"][1]) == (plan.pp, plan.virtual_stages)
    if not same_stages or out["recompute"] != ("none", 0):
        out[PER_STAGE] = ()  # the per-stage recompute holds only for the same stages, and without a uniform one
    fresh = plan_of(workload, out)
    if same_stages and plan.layer_split:
        fresh = fresh.with_(layer_split=plan.layer_split)
    return fresh


def _nearest(k: Knob, value, opts: list) -> int:
    positions = np.array([k.position_of(o, opts) for o in opts])
    return int(np.argmin(np.abs(positions - k.position_of(value, opts))))


def _variants(workload, plan: Plan) -> dict[str, list[tuple[str, Plan]]]:
    """Per row of the Why table, the single-knob neighbours of the plan, labelled."""
    values = values_of(plan)
    out: dict[str, list[tuple[str, Plan]]] = {}

    def add(row: str, label: str, change: dict) -> None:
        try:
            candidate = _complete(workload, plan, {**values, **change}, row)
            candidate.validate(workload)
        except (PlanError, IndexError):
            return
        if candidate != plan:
            out.setdefault(row, []).append((label, candidate))

    mine = {a: values[a] for a in axes.AXES}
    for degrees in degree_choices(workload):
        if degrees != mine:
            add(DEGREES, degrees_text(degrees), degrees)
    for k in decisions():
        if k.name in axes.AXES or (k.name == "recompute" and plan.stage_recompute):  # the per-stage row says it
            continue
        for value in choices(workload, k, values):
            if value != values[k.name]:
                add(k.name, k.text(value), {k.name: value})
    return out


def _chosen(plan: Plan, row: str) -> str:
    if row == DEGREES:
        return degrees_text({a: getattr(plan, a) for a in axes.AXES})
    k = next(k for k in knobs() if k.name == row)
    return k.text(k.value_of(plan))


def explain(workload, plan: Plan, coeffs=None, fastest: float | None = None) -> list[Reason]:
    """Per knob, what the best plan differing in that knob alone would cost. `fastest`: the iteration
    time of the fastest plan the search found, which ties count from (search/simplicity.py): an
    alternative simpler than `plan` and as fast as it may still lie outside that tie."""
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
                text = f"{flat[i - 1][1]} is as fast ({ratio - 1:+.1%}, within the {TIE:.1%} tie tolerance)"
                behind = res["iteration_time"][i] / fastest - 1 if fastest else 0.0
                if simpler:
                    text += "; the simpler plan is kept"
                elif behind >= TIE:  # simpler, yet not tied with the fastest plan found
                    text += (f", but {behind:.2%} behind the fastest plan found: ties count from the fastest, "
                             f"and the simplest plan within {TIE:.1%} of it is kept")
            else:
                text = f"{flat[i - 1][1]} is {1 - ratio:.1%} faster"
            if len(fit) < len(rows):
                text += f"; {len(rows) - len(fit)} other choice(s) do not fit in memory"
        else:
            i = min(rows, key=lambda j: res["peak_memory"][j])
            text = (f"no other choice fits in memory: the leanest, {flat[i - 1][1]}, needs "
                    f"{res['peak_memory'][i] / 1e9:.1f} GB > {memory / 1e9:.1f} GB usable")
        if knob in axes.FOLDED:  # a degree: against 1 and the neighbouring degree, then the fastest
            text = _against_neighbours(plan, knob, [(flat[i - 1][2], i) for i in rows], res, text)
        reasons.append(Reason(knob, _chosen(plan, knob), text))
    excluded = _excluded(workload)
    return reasons + excluded + _left_out(workload, reasons + excluded)


PART_WORDS = {"ep_comm": "all-to-all", "dp_comm": "gradient sync", "pp_bubble": "bubble"}  # else the part's name


def part_words(part: str) -> str:
    return PART_WORDS.get(part, part.replace("_", " "))


def _against_neighbours(plan: Plan, name: str, alternatives: list[tuple[Plan, int]], res, text: str) -> str:
    """A folded axis's degree (expert parallelism) against degree 1 and the next degree up (or down,
    at the largest): each one's time against the plan's and the part of the breakdown that moves most
    (`time_parts()`: the all-to-all, the experts' compute, ...), or that it does not fit; then `text`
    (the best alternative) where that is another degree."""
    mine = getattr(plan, name)
    by_degree = {getattr(p, name): i for p, i in alternatives}
    above = sorted(d for d in by_degree if d > mine)
    below = sorted(d for d in by_degree if 1 < d < mine)
    picks = ([1] if 1 in by_degree else []) + (above[:1] or below[-1:])
    parts = []
    for degree in picks:
        i = by_degree[degree]
        if not res["fits"][i]:
            parts.append(f"{name}{degree} does not fit ({res['peak_memory'][i] / 1e9:.1f} GB)")
            continue
        moved = max(time_parts(), key=lambda part: abs(res[part][i] - res[part][0]))
        delta = (res[moved][i] - res[moved][0]) * 1e3
        parts.append(f"{name}{degree} is {res['iteration_time'][i] / res['iteration_time'][0] - 1:+.1%} "
                     f"({part_words(moved)} {delta:+,.0f} ms)")
    named = [f"{name}{d}" for d in picks]
    rest = [clause for clause in text.split("; ") if not any(re.search(rf"\b{n}\b", clause) for n in named)]
    return "; ".join([", ".join(parts)] + rest)


def _excluded(workload) -> list[Reason]:
    """What the plan space leaves out for this model on this runtime, and why (autopar.capability);
    each in its knob's or axis's own row, so the degrees' row stays."""
    return [Reason(knob, "-", text) for _, knob, text in capability.excluded(capability.Target.of(workload))]


def _left_out(workload, shown: list[Reason]) -> list[Reason]:
    """Axes and folded axes of which the plan space offers no degree above 1 on this cluster, with the
    reason their own rule gives for the smallest degree (`autopar.axes`: `allowed`, and the space's
    narrower `offered`), unless a row in `shown` says it already: every exclusion, from the registries."""
    said = {r.text.split(" not considered")[0] for r in shown}
    space = axes.feasible_degrees(workload)
    above = axes.divisors(workload.world_size)[1:]
    defaults = {k.name: k.default for k in knobs()}
    out = []
    for name, axis in axes.AXES.items():
        if f"{name} > 1" in said or any(d[name] > 1 for d in space):
            continue
        why = next((w for d in above if (w := axis.allowed(workload, d) or (axis.offered and axis.offered(workload, d)))),
                   None)
        if why:
            out.append(Reason(name, "-", f"{name} > 1 not considered: {why}"))  # its own row: the degrees' stays
    for name, folded in axes.FOLDED.items():
        k = next(k for k in knobs() if k.name == name)
        offered = (k.choices(workload, {a: {**defaults, **d, "precision": workload.precision}[a]
                                        for a in depends_of(k)}) for d in space)
        if f"{name} > 1" in said or any(v > 1 for values in offered for v in values):
            continue
        why = next((w for d in above if (w := folded.allowed(workload, d))), None)
        if why:
            out.append(Reason(name, "-", f"{name} > 1 not considered: {why}"))
    return out


def bottleneck(breakdown: dict[str, float]) -> str:
    """The largest non-compute share of the iteration, in words."""
    total = sum(breakdown.values())
    parts = {k: v for k, v in breakdown.items() if k != "compute" and v > 0}
    name = max(parts, key=parts.get) if parts else None
    if total <= 0 or name is None or parts[name] < 0.01 * total:
        return f"compute-bound, {breakdown.get('compute', 0) / max(total, 1e-30):.0%} of the iteration is compute"
    return f"{name.replace('_', ' ')} takes {parts[name] / total:.0%} of the iteration"

