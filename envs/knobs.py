"""The plan space of `autopar.search.space` as a sequence of decisions, one knob per step.

The environment (training) and the RL planner (decoding) share this module, so a policy sees
exactly the choices it was trained on. The decisions are the knobs of `autopar.knobs` (derived
ones, like dp, are never asked); each knob's choices given the earlier ones come from the one
walker of the space (`autopar.search.space`); each choice has an action slot (`Knob.slot_of`),
and `StepInfo.allowed` masks the slots that cannot lead to a plan of the space that fits in
memory.

The memory mask evaluates, with the vectorised cost model, every choice of the current knob
completed by the *lean* values of the later knobs (`Knob.lean`): the values among which the
least memory of any completion is found. Memory does not grow as the micro-batch shrinks, with
sequence parallelism, a smaller DDP bucket or a narrower gradient dtype, so those take their
leanest value; degrees, ZeRO stage, offload, schedule and the recompute extremes (none,
selective, one block, every block) interact with the pipeline split and are all kept. A choice
is masked only when none of its lean completions fits, so every fitting plan of the space stays
reachable, and at the last step (nothing left to complete) the mask is exact: every sequence
the masks allow ends in a valid plan that fits. (A choice list longer than MAX_ACTIONS, which
takes a GPU count or batch with more divisors than any realistic one, is thinned evenly.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar import axes
from autopar.cost import PlanArrays, evaluate
from autopar.cost.arrays import SplitTable
from autopar.knobs import Knob, decisions, knobs
from autopar.plan import Plan
from autopar.search import space as walker

MAX_ACTIONS = 64  # Discrete(MAX_ACTIONS): the longest choice list (degrees, micro-batches, recompute counts)


@dataclass(frozen=True)
class StepInfo:
    """The decision at one step: the knob's choices, their action slots, which are allowed, and
    per choice the least memory and the fastest fitting time of its lean completions."""

    knob: str
    values: tuple  # the choices, in slot order
    slots: np.ndarray  # action index of each choice
    allowed: np.ndarray  # bool per choice
    memory: np.ndarray  # least peak bytes per GPU of the lean completions
    time: np.ndarray  # fastest iteration time of the fitting lean completions (inf: none fits)
    evaluations: int  # plans the cost model evaluated for this step

    def mask(self) -> np.ndarray:
        out = np.zeros(MAX_ACTIONS, dtype=bool)
        out[self.slots[self.allowed]] = True
        return out

    def value_at(self, action: int):
        index = np.flatnonzero(self.slots == action)
        if len(index) == 0 or not self.allowed[index[0]]:
            raise ValueError(f"action {action} is masked at the {self.knob} step")
        return self.values[index[0]]


def thin(values: list) -> list:
    """At most MAX_ACTIONS values, evenly spread over the ascending list (ends kept)."""
    if len(values) <= MAX_ACTIONS:
        return list(values)
    keep = np.unique(np.round(np.linspace(0, len(values) - 1, MAX_ACTIONS)).astype(int))
    return [values[i] for i in keep]


def indexed(k: Knob) -> bool:
    """Slots by position among the workload's choices (degrees, micro-batch), not fixed per value."""
    return k.slots is None and k.slot is None


class PlanSpace:
    """One workload's plan space as decisions. `step(prefix)` is memoised: every episode of a
    workload starts with the same first decisions. A prefix holds the values of the first
    decisions, in the order of `self.knobs`."""

    MEMO_LIMIT = 50_000

    def __init__(self, workload, coeffs=None):
        self.workload = workload
        self.coeffs = coeffs
        self.knobs = decisions()
        self.names = tuple(k.name for k in self.knobs)
        self.capacity = workload.memory_budget
        self.table = SplitTable(workload.profile)
        self._memo: dict[tuple, StepInfo] = {}
        self.choices_memo: dict = {}  # each knob's choices per value of its dependencies (walker.choices, walk)
        self.evaluations = 0  # plans evaluated by the cost model for steps not yet memoised

    def decided(self, prefix: tuple) -> dict:
        """The knob values a prefix fixes, with the derived knobs (dp, micro-batches) they determine."""
        out, given = {}, iter(prefix)
        for k in knobs():
            if k.decision:
                value = next(given, _MISSING)
                if value is _MISSING:
                    break
                out[k.name] = value
            else:
                out[k.name] = walker.choices(self.workload, k, out, self.choices_memo)[0]
        return out

    def dp_of(self, prefix: tuple) -> int:
        return self.decided(prefix)[axes.derived_axis()]

    # -- the decision at a step ------------------------------------------------------------------------
    def choices(self, prefix: tuple) -> list:
        """The choices of decision len(prefix) given the earlier ones, in slot order."""
        k = self.knobs[len(prefix)]
        opts = walker.choices(self.workload, k, self.decided(prefix), self.choices_memo)
        return thin(opts) if indexed(k) else sorted(opts, key=lambda v: k.slot_of(v, opts))

    def slot_of(self, knob: str, value, choices: list) -> int:
        return self.knobs[self.names.index(knob)].slot_of(value, choices)

    def advance(self, prefix: tuple, last: int | None = None) -> tuple:
        """Apply the decisions whose mask leaves a single choice, up to decision index `last`: they
        are no decision (a model without a tensor-parallel plan never decides tp)."""
        return self.advance_each([prefix], last)[0]

    def advance_each(self, prefixes: list[tuple], last: int | None = None) -> list[tuple]:
        """`advance` of each prefix, their steps priced together decision by decision (`prefetch`)."""
        last = len(self.knobs) if last is None else last
        out, live = list(prefixes), [i for i, p in enumerate(prefixes) if len(p) < last]
        while live:
            self.prefetch([out[i] for i in live])
            moved = []
            for i in live:
                info = self.step(out[i])
                if info.allowed.sum() == 1:
                    out[i] += (info.values[int(np.flatnonzero(info.allowed)[0])],)
                    if len(out[i]) < last:
                        moved.append(i)
            live = moved
        return out

    def step(self, prefix: tuple) -> StepInfo:
        info = self._memo.get(prefix)
        if info is None:
            self.prefetch([prefix])
            info = self._memo[tuple(prefix)]
        return info

    def prefetch(self, prefixes: list[tuple]) -> None:
        """Memoise the steps of these prefixes, those not yet memoised priced in one cost-model call: a call's
        fixed cost (about a millisecond) is most of one step's, and lockstep decoding asks many at once."""
        todo = list(dict.fromkeys(tuple(p) for p in prefixes if tuple(p) not in self._memo))
        if not todo:
            return
        if len(self._memo) + len(todo) > self.MEMO_LIMIT:
            self._memo.clear()
        for prefix, info in zip(todo, self._steps(todo)):
            self._memo[prefix] = info
            self.evaluations += info.evaluations

    def _steps(self, prefixes: list[tuple]) -> list[StepInfo]:
        """The decision after each prefix, every prefix's lean completions evaluated in one call."""
        built = []
        for prefix in prefixes:
            choices = self.choices(prefix)
            built.append((prefix, choices, *self._completions(prefix, choices)))
        batch = [pa for _, _, pa, _ in built if len(pa)]
        res = evaluate(self.workload, PlanArrays.joined(batch), self.coeffs) if batch else {}
        out, start = [], 0
        for prefix, choices, pa, cand in built:
            k = self.knobs[len(prefix)]
            memory, time = np.full(len(choices), np.inf), np.full(len(choices), np.inf)
            if len(pa):
                rows = slice(start, start + len(pa))
                start += len(pa)
                np.minimum.at(memory, cand, res["peak_memory"][rows])
                fit = res["fits"][rows]
                np.minimum.at(time, cand[fit], res["iteration_time"][rows][fit])
            slots = np.array([k.slot_of(c, choices) for c in choices], dtype=np.int64)
            out.append(StepInfo(k.name, tuple(choices), slots, np.isfinite(time), memory, time, len(pa)))
        return out

    def _completions(self, prefix: tuple, choices: list, lean: bool = True) -> tuple[PlanArrays, np.ndarray]:
        """Every choice of decision len(prefix) completed by the lean values of the later decisions
        (or by all their values, lean=False), with the earlier ones fixed: the plans and, per plan,
        the index of its choice."""
        pick = {name: _only(value) for name, value in zip(self.names, prefix)}
        expand = self.names[len(prefix)]
        pick[expand] = _among(choices)
        if lean:
            pick.update({k.name: k.lean for k in self.knobs[len(prefix) + 1:]})
        w = walker.walk(self.workload, pick, self.choices_memo)
        if w.size == 0:
            return PlanArrays.empty(self.table), np.zeros(0, dtype=np.int64)
        index = np.array([choices.index(v) for v in w.values[expand]], dtype=np.int64)
        return walker.to_arrays(w, self.table), index[w.codes[expand]]

    def best_completion(self, prefix: tuple) -> tuple | None:
        """The decision values of the fastest fitting plan that starts with `prefix`, found
        exhaustively (the expert that labels off-path decisions in training); None if none fits."""
        if len(prefix) == len(self.knobs):
            return prefix
        pa, _ = self._completions(prefix, self.choices(prefix), lean=False)
        if not len(pa):
            return None
        res = evaluate(self.workload, pa, self.coeffs)
        fit = np.flatnonzero(res["fits"])
        if not len(fit):
            return None
        return self.prefix_of(pa.plan(int(fit[np.argmin(res["iteration_time"][fit])])))

    # -- the finished plan -----------------------------------------------------------------------------
    def prefix_of(self, plan: Plan) -> tuple:
        """The decision values that stand for a plan of the space (the inverse of `plan`)."""
        values = walker.values_of(plan)
        return tuple(values[name] for name in self.names)

    def plan(self, prefix: tuple) -> Plan:
        """The plan a complete sequence of choices stands for."""
        if len(prefix) != len(self.knobs):
            raise ValueError(f"a plan needs all {len(self.knobs)} decisions, got {len(prefix)}")
        return walker.plan_of(self.workload, self.decided(prefix))


_MISSING = object()


def _only(value):
    return lambda choices: [c for c in choices if c == value]


def _among(allowed: list):
    keep = set(allowed)
    return lambda choices: [c for c in choices if c in keep]
