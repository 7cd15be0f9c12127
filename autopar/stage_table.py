"""The per-stage view of a plan (issue 41), for `autopar search` and `autopar explain`: a row per
pipeline rank with its virtual stages, their blocks and recompute, and the rank's time per
micro-batch and peak memory, each rank priced alone by the cost model's own `evaluate` (a
`RankTable` entry per rank, as the per-stage solver prices them: no second cost model); and a Why
row saying what the per-stage choice bought against the best uniform plan of the same outer
knobs (balanced split, one recompute setting for every rank)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.table import Table

from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost.arrays import RankTable, SplitTable
from autopar.errors import PlanError
from autopar.explain import Reason
from autopar.knobs import balanced_split, knob, rank_stages, stage_full_blocks
from autopar.plan import Plan
from autopar.search.space import choices, plan_of, values_of

ROW = "stage_recompute"  # the Why row's knob: the per-stage choice (split and recompute)


@dataclass(frozen=True)
class RankRow:
    """One pipeline rank: its virtual stages (pipeline order), their blocks and recompute entries,
    whether it runs the embedding / the head, its time per micro-batch (forward and backward of all
    its stages) and its peak memory."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[int, ...]
    recompute: tuple[str, ...]
    embedding: bool
    head: bool
    time_per_micro_batch_s: float
    memory_bytes: float

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages), "blocks": list(self.blocks),
                "recompute": list(self.recompute), "embedding": self.embedding, "head": self.head,
                "time_per_micro_batch_s": self.time_per_micro_batch_s, "memory_bytes": self.memory_bytes}


def is_per_stage(workload, plan: Plan) -> bool:
    """Whether the plan chooses per stage: its own recompute per stage, or a split other than the balanced one."""
    layers = workload.profile.num_layers
    return bool(plan.stage_recompute) or (plan.pp > 1 and plan.split_for(layers) != balanced_split(layers, plan.stages))


def _recompute_of(plan: Plan, stages: tuple[int, ...]) -> tuple[str, ...]:
    """The rank's stages' own recompute entries, or the uniform setting every rank shares."""
    if plan.stage_recompute:
        return tuple(plan.stage_recompute[s] for s in stages)
    setting = f"full:{plan.recompute_blocks}" if plan.recompute == "full" else plan.recompute
    return (f"{setting} (uniform)",)


def _blocks_by_rank(profile, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pp, kinds): each rank's blocks by kind (the embedding and head as their kinds), and those a
    per-stage recompute recomputes fully and selectively (zero under a uniform one, which `evaluate`
    prices from the plan's recompute fields)."""
    before = SplitTable(profile).before  # blocks of each kind among the first i
    split = plan.split_for(profile.num_layers)
    starts = np.concatenate([[0], np.cumsum(split)]).astype(int)
    shape = (plan.pp, before.shape[1])
    counts, full, sel = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for rank in range(plan.pp):
        for s in rank_stages(plan.pp, plan.virtual_stages, plan.schedule, rank):
            a, n = starts[s], split[s]
            counts[rank] += before[a + n] - before[a]
            entry = plan.stage_recompute[s] if plan.stage_recompute else "none"
            full[rank] += before[a + stage_full_blocks(entry)] - before[a]
            sel[rank] += (before[a + n] - before[a]) * (entry == "selective")
            counts[rank, 0] += s == 0  # the embedding with the first stage, the head with the last
            counts[rank, -1] += s == plan.stages - 1
    return counts, full, sel


def rank_rows(workload, plan: Plan, coeffs: Coefficients | None = None) -> list[RankRow]:
    """Every pipeline rank of `plan`, priced alone (its own position, so its own micro-batches in flight)."""
    profile = workload.profile
    counts, full, sel = _blocks_by_rank(profile, plan)
    one = PlanArrays.from_plans([plan], profile)
    columns = {name: np.repeat(value, plan.pp) for name, value in one.columns.items()}
    columns["split"] = np.arange(plan.pp)
    res = evaluate(workload, PlanArrays(columns, RankTable(np.arange(plan.pp), counts, full, sel)), coeffs,
                   ranks=True)
    split = plan.split_for(profile.num_layers)
    rows = []
    for rank in range(plan.pp):
        stages = tuple(rank_stages(plan.pp, plan.virtual_stages, plan.schedule, rank))
        rows.append(RankRow(rank, stages, tuple(split[s] for s in stages), _recompute_of(plan, stages),
                            0 in stages, plan.stages - 1 in stages, float(res["rank_per_mb"][rank, 0]),
                            float(res["rank_memory"][rank, 0])))
    return rows


def stage_table(rows: list[RankRow], budget_bytes: float) -> Table:
    t = Table(title="Per stage (each pipeline rank priced alone)", title_justify="left",
              caption=f"memory budget {budget_bytes / 1e9:.1f} GB per GPU", caption_justify="left")
    for name in ("rank", "stage", "blocks", "recompute"):
        t.add_column(name)
    t.add_column("time / micro-batch", justify="right")
    t.add_column("memory", justify="right")
    for r in rows:
        ends = ["embedding"] * r.embedding + ["head"] * r.head
        blocks = _compact(r.blocks, " + ") + (f" ({', '.join(ends)})" if ends else "")
        stages = r.stages if len(r.stages) <= 3 else (r.stages[0], r.stages[1], "...", r.stages[-1])
        t.add_row(str(r.rank), ", ".join(map(str, stages)), blocks, _compact(r.recompute, ", "),
                  f"{r.time_per_micro_batch_s * 1e3:,.2f} ms", f"{r.memory_bytes / 1e9:.1f} GB")
    return t


def _compact(values, sep: str) -> str:
    """A rank's per-chunk values with repeats folded: "2 x 6", "none x 2, selective x 4"."""
    runs: list[list] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return sep.join(f"{v} x {n}" if n > 1 else str(v) for v, n in runs)


def _runs(items: list[tuple[int, str]]) -> list[tuple[str, str]]:
    """Consecutive stages with the same value: ("stages 1-2", value) or ("stage 3", value)."""
    out: list[list] = []
    for stage, value in items:
        if out and out[-1][2] == value and out[-1][1] == stage - 1:
            out[-1][1] = stage
        else:
            out.append([stage, stage, value])
    return [(f"stages {a}-{b}" if b > a else f"stage {a}", value) for a, b, value in out]


def changes(workload, plan: Plan) -> str:
    """What the plan chooses per stage, in words."""
    layers = workload.profile.num_layers
    split = plan.split_for(layers)
    said = []
    if split[0] == 0:
        said.append("stage 0 holds the embedding only")
    if split[-1] == 0:
        said.append(f"stage {len(split) - 1} holds the head only")
    balanced = balanced_split(layers, plan.stages)
    if split != balanced:
        said.append(f"blocks per stage {'/'.join(map(str, split))} (balanced: {'/'.join(map(str, balanced))})")
    if plan.stage_recompute:
        words = {"none": "recompute nothing", "selective": "recompute selectively"}  # plural; one stage: "recomputes"
        held = [(s, e) for s, e in enumerate(plan.stage_recompute) if split[s] > 0]
        for where, entry in _runs(held):
            k = stage_full_blocks(entry)
            verb = words.get(entry, f"recompute {k} block{'s' * (k > 1)}")
            one = not where.startswith("stages")  # "stage 3 recomputes", "stages 1-2 recompute"
            said.append(f"{where} {verb.replace('recompute', 'recomputes', 1) if one else verb}")
    return ", ".join(said)


def _uniform(workload, plan: Plan) -> list[tuple[str, Plan]]:
    """The plan's outer knobs with a balanced split and each uniform recompute choice."""
    outer = plan.with_(layer_split=(), stage_recompute=(), recompute="none", recompute_blocks=0)
    values = values_of(outer)
    k, out = knob("recompute"), []
    for value in choices(workload, k, values):
        try:
            candidate = plan_of(workload, {**values, k.name: value})
            candidate.validate(workload)
        except PlanError:
            continue
        out.append((f"balanced split, {k.text(value)}", candidate))
    return out


def stage_reason(workload, plan: Plan, coeffs: Coefficients | None = None) -> list[Reason]:
    """The Why row of a per-stage plan (none for a uniform plan with the balanced split)."""
    if not is_per_stage(workload, plan):
        return []
    uniform = _uniform(workload, plan)
    res = evaluate(workload, PlanArrays.from_plans([plan] + [p for _, p in uniform], workload.profile), coeffs)
    chosen = "per-stage choice"
    what = changes(workload, plan)
    fit = [i for i in range(1, len(uniform) + 1) if res["fits"][i]]
    if not fit:
        if not uniform:
            return [Reason(ROW, chosen, f"no uniform plan of these degrees is valid: {what}")]
        i = min(range(1, len(uniform) + 1), key=lambda j: res["peak_memory"][j])
        return [Reason(ROW, chosen, f"no uniform plan of these degrees fits (the leanest, {uniform[i - 1][0]}, needs "
                                    f"{res['peak_memory'][i] / 1e9:.1f} GB > {workload.memory_budget / 1e9:.1f} GB "
                                    f"usable): {what}")]
    i = min(fit, key=lambda j: res["iteration_time"][j])
    ratio = res["iteration_time"][0] / res["iteration_time"][i]
    if ratio < 1 / 1.0005:
        than = f"{1 - ratio:.1%} faster than"
    elif ratio > 1.0005:
        than = f"{ratio - 1:.1%} slower than"
    else:
        than = "as fast as"
    return [Reason(ROW, chosen, f"per-stage plan: {than} the best uniform plan ({uniform[i - 1][0]}): {what}")]
