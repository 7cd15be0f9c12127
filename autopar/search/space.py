"""The one walker of the plan space: every planner and the RL environment walk it.

The space is the knobs of `autopar.knobs` in decision order, each with its choices given the
earlier knobs it depends on. `walk` grows every partial plan knob by knob, as columns of value
codes, calling a knob's `choices` once per distinct value of its dependencies (so the
exhaustive space of a 320-GPU workload, a quarter of a million plans, takes a fraction of a
second); `pick` narrows a knob's choices (to a fixed value, to its lean values), which is how the
RL environment builds the completions its memory masks evaluate. `sample` takes one path, one
knob at a time, for the sampling planners. Knobs that cannot matter have a single canonical
choice (no ZeRO, bucket or gradient dtype without data parallelism; no sequence parallel without
tensor parallelism), so the space holds no duplicate plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar import axes
from autopar.cost.arrays import PlanArrays, SplitTable, encode
from autopar.errors import AutoparError
from autopar.knobs import Knob, depends_of, knobs
from autopar.plan import Plan

Pick = Callable[[list], list]  # a knob's choices -> the ones to walk
MAX_PLANS = 10_000_000  # rows one walk may build (~1.5 GB of PlanArrays); a 175B GPT on 1,024 GPUs has 1.5M


@dataclass
class Walk:
    """Partial (or complete) plans: per knob walked, the distinct values met and a code column."""

    values: dict[str, list]
    codes: dict[str, np.ndarray]
    size: int

    def value(self, name: str, row: int):
        return self.values[name][int(self.codes[name][row])]


def choices(workload, k: Knob, decided: dict) -> list:
    """A knob's choices given the values decided so far (only its dependencies are read)."""
    return k.choices(workload, {d: decided[d] for d in depends_of(k)})


def walk(workload, pick: dict[str, Pick] | None = None) -> Walk:
    """Every plan of the space, each knob narrowed by `pick` where given."""
    pick = pick or {}
    w = Walk({}, {}, 1)
    for k in knobs():
        deps = depends_of(k)
        if deps:
            key = np.zeros(w.size, dtype=np.int64)
            for d in deps:
                key = key * (len(w.values[d]) + 1) + w.codes[d]
            uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        else:
            first, inverse = np.zeros(1, dtype=np.int64), np.zeros(w.size, dtype=np.int64)
        known: dict = {}
        table: list[np.ndarray] = []
        for row in first:
            opts = choices(workload, k, {d: w.value(d, row) for d in deps})
            if k.name in pick:
                opts = pick[k.name](opts)
            table.append(np.array([known.setdefault(v, len(known)) for v in opts], dtype=np.int64))
        counts = np.array([len(t) for t in table], dtype=np.int64)[inverse.reshape(-1)]
        flat = np.concatenate(table) if table else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in table])[:-1]]).astype(np.int64)
        total = int(counts.sum())
        if total > MAX_PLANS:  # bounded memory and time, whatever the workload
            raise AutoparError(f"the plan space of {workload.describe()} has more than {MAX_PLANS:,} plans; "
                               f"autopar enumerates at most {MAX_PLANS:,}: use --method rl, optuna or "
                               f"random, which sample it, or fewer GPUs or a smaller global batch")
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        within = np.arange(total) - starts
        column = flat[np.repeat(offsets[inverse.reshape(-1)], counts) + within]
        w.codes = {name: np.repeat(col, counts) for name, col in w.codes.items()}
        w.codes[k.name] = column
        w.values[k.name] = list(known)
        w.size = total
        if total == 0:
            break
    return w


def to_arrays(w: Walk, table: SplitTable) -> PlanArrays:
    """The plans of a complete walk as PlanArrays (the balanced layer split for each)."""
    if w.size == 0:
        return PlanArrays.empty(table)
    cols: dict[str, np.ndarray] = {}
    for k in knobs():
        encoded = np.array([[encode(f, v) for f, v in zip(k.fields, _parts(k, value))] for value in w.values[k.name]])
        for j, f in enumerate(k.fields):
            cols[f.name] = encoded[w.codes[k.name], j]
    cols["split"] = table.add_balanced(cols["pp"].astype(np.int64), cols["virtual_stages"].astype(np.int64))
    return PlanArrays(cols, table)


def _parts(k: Knob, value) -> tuple:
    return (value,) if len(k.fields) == 1 else value


def enumerate_plans(workload) -> PlanArrays:
    """Every plan of the space (the exhaustive oracle's input)."""
    return to_arrays(walk(workload), SplitTable(workload.profile))


def plan_of(workload, values: dict) -> Plan:
    """The plan of one value per knob: the one place a Plan is assembled from knob values."""
    fields: dict = {}
    for k in knobs():
        fields.update(k.assign(values[k.name]))
    return Plan(**fields)


def values_of(plan: Plan) -> dict:
    """The knob values of a plan (the inverse of `plan_of`)."""
    return {k.name: k.value_of(plan) for k in knobs()}


def sample(workload, choose: Callable[[Knob, list], int]) -> Plan:
    """One plan of the space: each decision picked by `choose(knob, choices)` (an index)."""
    decided: dict = {}
    for k in knobs():
        opts = choices(workload, k, decided)
        decided[k.name] = opts[choose(k, opts)] if k.decision and len(opts) > 1 else opts[0]
    return plan_of(workload, decided)


def degree_choices(workload) -> list[dict[str, int]]:
    """The degrees of every axis the workload allows (see `autopar.axes.feasible_degrees`)."""
    return axes.feasible_degrees(workload)
