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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar import axes
from autopar.cost.arrays import PlanArrays, SplitTable, encode
from autopar.errors import AutoparError, NoValidPlanError
from autopar.knobs import Knob, depends_of, knob, knobs
from autopar.plan import Plan

Pick = Callable[[list], list]  # a knob's choices -> the ones to walk
CODE = np.int16  # a knob's value codes: a few hundred values at most, and a walk repeats them for every row
FEW = 64  # partial plans up to which `walk` steps in Python lists (`_grow_few`)
MAX_PLANS = 10_000_000  # rows one walk may build (~1.5 GB of PlanArrays); a 175B GPT on 1,024 GPUs has 1.5M


@dataclass
class Walk:
    """Partial (or complete) plans: per knob walked, the distinct values met and a code column."""

    values: dict[str, list]
    codes: dict[str, np.ndarray]
    size: int

    def value(self, name: str, row: int):
        return self.values[name][int(self.codes[name][row])]


def choices(workload, k: Knob, decided: dict, memo: dict | None = None) -> list:
    """A knob's choices given the values decided so far (only its dependencies are read), narrowed
    to the value the workload holds it at (`Workload.fixed`, `search --fix`). `memo` keeps them per
    value of the dependencies, for one workload (see `walk`)."""
    given = tuple(decided[d] for d in depends_of(k))
    if memo is not None and (k.name, given) in memo:
        return memo[k.name, given]
    opts = k.choices(workload, dict(zip(depends_of(k), given)))
    held = dict(getattr(workload, "fixed", ()))
    opts = narrow(held[k.name], opts) if k.name in held else opts
    if memo is not None:
        memo[k.name, given] = opts
    return opts


def narrow(value, opts: list) -> list:
    """The choices equal to a held value; a part held as None takes the largest choice with the rest
    (`--fix recompute=full`: every block of the busiest rank, as `--recompute full`)."""
    if isinstance(value, tuple) and None in value:
        return [o for o in opts if all(v is None or v == x for v, x in zip(value, o))][-1:]
    return [o for o in opts if o == value]


def held_fields(workload) -> dict:
    """The Plan fields of the held values that name one value (not `recompute=full`, resolved per plan)."""
    out: dict = {}
    for name, value in getattr(workload, "fixed", ()):
        if not (isinstance(value, tuple) and None in value):
            out.update(knob(name).assign(value))
    return out


def in_space(workload, plan: Plan) -> bool:
    """Whether the walk offers this plan: each knob's value among its choices given the others
    (held values included), for a plan a planner assembled itself."""
    values = values_of(plan)
    return all(values[k.name] in choices(workload, k, values) for k in knobs())


def holds(workload, plan: Plan) -> bool:
    """Whether a plan has every value the workload holds (a plan a planner built outside the walk)."""
    return all(narrow(value, [knob(name).value_of(plan)]) for name, value in getattr(workload, "fixed", ()))


def walk(workload, pick: dict[str, Pick] | None = None, memo: dict | None = None) -> Walk:
    """Every plan of the space, each knob narrowed by `pick` where given. `memo` keeps a knob's choices
    per value of its dependencies across walks of one workload (the RL planner walks one space a
    thousand times, each walk asking its knobs' choices some 45 times, mostly as earlier walks did)."""
    pick = pick or {}
    memo = {} if memo is None else memo

    def options(k: Knob, given: tuple) -> list:
        opts = memo.get((k.name, given))
        if opts is None:
            opts = choices(workload, k, dict(zip(depends_of(k), given)), memo)
        return pick[k.name](opts) if k.name in pick else opts

    w = Walk({}, {}, 1)
    for k in knobs():
        deps = depends_of(k)
        if w.size <= FEW:
            _grow_few(w, k, deps, options)
            if w.size == 0:
                break
            continue
        if deps:
            key = np.zeros(w.size, dtype=np.int64)
            for d in deps:
                key = key * (len(w.values[d]) + 1) + w.codes[d]
            uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        else:
            first, inverse = np.zeros(1, dtype=np.int64), np.zeros(w.size, dtype=np.int64)
        # the dependencies' values at each distinct row, column by column (a Python loop per row is most of a walk)
        given_at = list(zip(*([w.values[d][c] for c in w.codes[d][first].tolist()] for d in deps))) if deps \
            else [()]
        known = {}
        table: list[np.ndarray] = []
        for given in given_at:
            table.append(np.array([known.setdefault(v, len(known)) for v in options(k, given)], dtype=CODE))
        counts = np.array([len(t) for t in table], dtype=np.int64)[inverse.reshape(-1)]
        flat = np.concatenate(table) if table else np.zeros(0, dtype=CODE)
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in table])[:-1]]).astype(np.int64)
        total = int(counts.sum())
        if total > MAX_PLANS:  # bounded memory and time, whatever the workload
            raise AutoparError(f"the plan space of {workload.describe()} has more than {MAX_PLANS:,} plans; "
                               f"autopar enumerates at most {MAX_PLANS:,}: use --method rl, optuna or "
                               f"random, which sample it, or fewer GPUs or a smaller global batch")
        if total == w.size and (counts == 1).all():  # one choice per row (a held or narrowed knob): no rows added
            column = flat[offsets[inverse.reshape(-1)]]
        else:
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


def _grow_few(w: Walk, k: Knob, deps: tuple, options: Callable[[Knob, tuple], list]) -> None:
    """`walk`'s step for a few partial plans (a prefix's values, a neighbour's), in Python lists: numpy's
    grouping costs more than it saves on a few rows (the RL planner's walks: median 6 plans). Codes come
    out as the grouped step numbers them: choices in the order of their dependencies' codes."""
    dep_codes = list(zip(*(w.codes[d].tolist() for d in deps))) if deps else [()] * w.size
    known: dict = {}
    coded = {}
    for group in sorted(set(dep_codes)):  # np.unique's order of the mixed-radix keys
        given = tuple(w.values[d][c] for d, c in zip(deps, group))
        coded[group] = [known.setdefault(v, len(known)) for v in options(k, given)]
    per_row = [coded[group] for group in dep_codes]
    counts = [len(c) for c in per_row]
    if any(n != 1 for n in counts):
        w.codes = {name: np.repeat(col, counts) for name, col in w.codes.items()}
    w.codes[k.name] = np.array([c for row in per_row for c in row], dtype=CODE)
    w.values[k.name] = list(known)
    w.size = sum(counts)


def to_arrays(w: Walk, table: SplitTable) -> PlanArrays:
    """The plans of a complete walk as PlanArrays (the balanced layer split for each)."""
    if w.size == 0:
        return PlanArrays.empty(table)
    cols: dict[str, np.ndarray] = {}
    for k in knobs():
        encoded = np.array([[encode(f, v) for f, v in zip(k.fields, _parts(k, value))] for value in w.values[k.name]])
        for j, f in enumerate(k.fields):
            cols[f.name] = encoded[w.codes[k.name], j]
    cols["split"] = table.add_balanced(cols["pp"].astype(np.int64), cols["virtual_stages"].astype(np.int64),
                                       cols["schedule"].astype(np.int64))
    return PlanArrays(cols, table)


def _parts(k: Knob, value) -> tuple:
    return (value,) if len(k.fields) == 1 else value


def enumerate_plans(workload, held: dict | None = None) -> PlanArrays:
    """Every plan of the space (the exhaustive oracle's input), or those with the `held` knob values
    (knob name -> value): the same plans, walked without building the rest."""
    pick = {name: functools.partial(narrow, value) for name, value in (held or {}).items()}
    return to_arrays(walk(workload, pick), SplitTable(workload.profile))


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
    """One plan of the space: each decision picked by `choose(knob, choices)` (an index). A pick
    after which a later knob has no choice (a held value that earlier picks exclude: `--fix compile=true`
    after tp=2) is replaced by the nearest one that leads to a plan: a depth-first walk that remembers
    dead ends by what the later knobs read, so it never retries one. Without held knobs no pick is a
    dead end and `choose` alone decides."""
    ks = knobs()
    read_later = [sorted({d for k in ks[i:] for d in depends_of(k)} & {k.name for k in ks[:i]})
                  for i in range(len(ks) + 1)]
    decided: dict = {}
    dead: set = set()

    def grow(i: int) -> bool:
        if i == len(ks):
            return True
        key = (i, tuple(decided[d] for d in read_later[i]))
        if key in dead:
            return False
        k = ks[i]
        opts = choices(workload, k, decided)
        first = choose(k, opts) if opts and k.decision and len(opts) > 1 else 0
        for j in sorted(range(len(opts)), key=lambda j: (abs(j - first), j)):
            decided[k.name] = opts[j]
            if grow(i + 1):
                return True
        decided.pop(k.name, None)
        dead.add(key)
        return False

    if not grow(0):
        raise NoValidPlanError(f"no plan of {workload.describe()} has every held value "
                               f"({', '.join(f'{n}={v}' for n, v in getattr(workload, 'fixed', ()))})")
    return plan_of(workload, decided)


def degree_choices(workload) -> list[dict[str, int]]:
    """The degrees of every axis the workload allows (see `autopar.axes.feasible_degrees`), with the
    degrees it holds (`Workload.fixed`)."""
    held = [(a, v) for a, v in getattr(workload, "fixed", ()) if a in axes.AXES]
    return [d for d in axes.feasible_degrees(workload) if all(d[a] == v for a, v in held)]
