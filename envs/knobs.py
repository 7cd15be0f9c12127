"""The plan space of `autopar.search.space` as a sequence of decisions, one knob per step.

The environment (training) and the RL planner (decoding) share this module, so a policy sees
exactly the choices it was trained on. Each knob's choices given the earlier ones come from the
space functions; each choice has a fixed action slot (`slot_of`), and `StepInfo.allowed` masks
the slots that cannot lead to a plan of the space that fits in memory.

The memory mask evaluates, with the vectorised cost model, every choice of the current knob
completed by the *lean* values of the later knobs: the values among which the least memory of
any completion is found. Memory does not grow as the micro-batch shrinks, with sequence
parallelism, a smaller DDP bucket or a narrower gradient dtype, so those take their leanest
value; tensor degree, ZeRO stage with offload, schedule and the recompute extremes (none,
selective, one block, every block) interact with the pipeline split and are all kept. A choice
is masked only when none of its lean completions fits, so every fitting plan of the space stays
reachable, and at the last step (nothing left to complete) the mask is exact: every sequence
the masks allow ends in a valid plan that fits. (A choice list longer than MAX_ACTIONS, which
takes a GPU count or batch with more divisors than any realistic one, is thinned evenly.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from autopar.cost import PlanArrays, evaluate
from autopar.cost.arrays import DTYPE_BYTES, MESH_ORDERS, SplitTable
from autopar.plan import COMM_DTYPES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, Plan, balanced_split
from autopar.search.space import (BUCKETS_MB, INNER, MAX_VIRTUAL_STAGES, _data_parallel_options, degree_choices,
                                  micro_batch_choices, recompute_choices, schedule_choices)

KNOBS = ("pp", "tp", "micro_batch", "zero", "recompute", "bucket", "schedule", "sequence_parallel", "comm_dtype",
         "mesh_order")
MAX_ACTIONS = 64  # Discrete(MAX_ACTIONS): the longest choice list (degrees, micro-batches, recompute counts)
ZERO_SLOTS = ((0, False), (1, False), (2, False), (2, True), (3, False), (3, True))  # (stage, CPU offload)
SCHEDULE_SLOTS = (("gpipe", 1), ("1f1b", 1)) + tuple(("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1))
RECOMPUTE_SLOTS = 2  # slot 0: none, slot 1: selective, slot 2 + i: full recompute of the i-th count
INDEXED = ("pp", "tp", "micro_batch")  # slot = position in the ascending list of this workload's choices
# the data-parallel knobs are columns of space._data_parallel_options
DP_COLUMNS = {"zero": (INNER.index("zero"), INNER.index("offload")), "bucket": (INNER.index("bucket_mb"),),
              "sequence_parallel": (INNER.index("sp"),), "comm_dtype": (INNER.index("comm"),),
              "mesh_order": (INNER.index("order"),)}
LOG2_MAX_GPUS = 14.0  # 16,384 GPUs: the scale of every degree and micro-batch feature


def space_signature() -> str:
    """A digest of everything a trained policy depends on in the space: knob order, slot tables,
    action count. A policy trained under another signature would read its actions differently."""
    from autopar.envs.features import FEATURE_VERSION, observation_size

    spec = {"knobs": KNOBS, "max_actions": MAX_ACTIONS, "zero": ZERO_SLOTS, "schedule": SCHEDULE_SLOTS,
            "recompute": [RECOMPUTE_SLOTS, RECOMPUTE_MODES], "buckets": BUCKETS_MB, "comm": COMM_DTYPES,
            "mesh": MESH_ORDERS, "indexed": INDEXED, "features": [FEATURE_VERSION, observation_size()]}
    return hashlib.sha256(json.dumps(spec, default=list).encode()).hexdigest()[:16]


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


class PlanSpace:
    """One workload's plan space as decisions. `step(prefix)` is memoised: every episode of a
    workload starts with the same first decisions."""

    MEMO_LIMIT = 50_000

    def __init__(self, workload, coeffs=None):
        self.workload = workload
        self.coeffs = coeffs
        self.capacity = workload.memory_budget
        self.table = SplitTable(workload.profile)
        self._memo: dict[tuple, StepInfo] = {}
        self.evaluations = 0  # plans evaluated by the cost model for steps not yet memoised

    # -- structural choices ------------------------------------------------------------------------
    @cached_property
    def degrees(self) -> list[tuple[int, int, int]]:
        return degree_choices(self.workload)

    def pp_choices(self) -> list[int]:
        return thin(sorted({pp for _, _, pp in self.degrees}))

    def tp_choices(self, pp: int) -> list[int]:
        return thin(sorted(tp for _, tp, p in self.degrees if p == pp))

    def mbs_choices(self, dp: int) -> list[int]:
        return thin(micro_batch_choices(self.workload, dp))

    def recompute_choices(self, pp: int) -> list[tuple[str, int]]:
        # interleaving needs blocks divisible by pp x v, so the busiest rank holds as many blocks
        # as without it: the choices do not depend on the schedule chosen later
        return recompute_choices(self.workload, pp, 1)

    def schedule_choices(self, pp: int, nmb: int) -> list[tuple[str, int]]:
        return schedule_choices(self.workload, pp, nmb)

    def dp_rows(self, dp: int, tp: int) -> np.ndarray:
        return _data_parallel_options(self.workload, dp, tp)

    def dp_of(self, pp: int, tp: int) -> int:
        return self.workload.world_size // (pp * tp)

    # -- slots -------------------------------------------------------------------------------------
    def slot_of(self, knob: str, value, choices: list) -> int:
        """The action index of a choice: its position for the indexed knobs, else a fixed slot."""
        if knob in INDEXED:
            return choices.index(value)
        if knob == "recompute":
            mode = value[0]
            if mode == "full":
                return RECOMPUTE_SLOTS + [c for c in choices if c[0] == "full"].index(value)
            return ("none", "selective").index(mode)
        table = {"zero": ZERO_SLOTS, "bucket": BUCKETS_MB, "schedule": SCHEDULE_SLOTS}.get(knob)
        return table.index(value) if table else int(value)  # sp, comm dtype and mesh order: codes

    # -- the decision at a step ------------------------------------------------------------------------
    def choices(self, prefix: tuple) -> list:
        """The structural choices of knob len(prefix) given the earlier ones, in slot order."""
        knob, fixed = KNOBS[len(prefix)], dict(zip(KNOBS, prefix))
        if knob == "pp":
            return self.pp_choices()
        pp = fixed["pp"]
        if knob == "tp":
            return self.tp_choices(pp)
        dp = self.dp_of(pp, fixed["tp"])
        if knob == "micro_batch":
            return self.mbs_choices(dp)
        if knob == "recompute":
            return self.recompute_choices(pp)
        if knob == "schedule":
            return self.schedule_choices(pp, self.workload.global_batch // (dp * fixed["micro_batch"]))
        rows = _filter_rows(self.dp_rows(dp, fixed["tp"]), fixed)
        values = sorted({_row_value(knob, r) for r in rows})
        return sorted(values, key=ZERO_SLOTS.index) if knob == "zero" else values

    def advance(self, prefix: tuple, last: int = len(KNOBS)) -> tuple:
        """Apply the knobs whose mask leaves a single choice, up to knob index `last`: they are
        no decision (a model without a tensor-parallel plan never decides tp)."""
        while len(prefix) < last:
            info = self.step(prefix)
            if info.allowed.sum() != 1:
                break
            prefix += (info.values[int(np.flatnonzero(info.allowed)[0])],)
        return prefix

    def step(self, prefix: tuple) -> StepInfo:
        info = self._memo.get(prefix)
        if info is None:
            info = self._step(tuple(prefix))
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            self._memo[tuple(prefix)] = info
            self.evaluations += info.evaluations
        return info

    def _step(self, prefix: tuple) -> StepInfo:
        knob = KNOBS[len(prefix)]
        choices = self.choices(prefix)
        pa, cand = self._completions(prefix, choices)
        memory, time = np.full(len(choices), np.inf), np.full(len(choices), np.inf)
        if len(pa):
            res = evaluate(self.workload, pa, self.coeffs)
            np.minimum.at(memory, cand, res["peak_memory"])
            fit = res["fits"]
            np.minimum.at(time, cand[fit], res["iteration_time"][fit])
        slots = np.array([self.slot_of(knob, c, choices) for c in choices], dtype=np.int64)
        return StepInfo(knob, tuple(choices), slots, np.isfinite(time), memory, time, len(pa))

    def _completions(self, prefix: tuple, choices: list, lean: bool = True) -> tuple[PlanArrays, np.ndarray]:
        """Every choice of knob len(prefix) completed by the lean values of the later knobs (or by
        all their values, lean=False), with the earlier ones fixed: the plans and, per plan, the
        index of its choice."""
        w, fixed = self.workload, dict(zip(KNOBS, prefix))
        expand = KNOBS[len(prefix)]
        index = {c: i for i, c in enumerate(choices)}
        precision = PRECISIONS.index(w.precision)

        def values(knob, structural, leanest):
            if knob in fixed:
                return [fixed[knob]]
            return structural() if knob == expand or not lean else leanest()

        cols: dict[str, list] = {name: [] for name in PlanArrays._columns()}
        cand: list[np.ndarray] = []
        for pp in values("pp", self.pp_choices, self.pp_choices):
            for tp in values("tp", lambda: self.tp_choices(pp), lambda: self.tp_choices(pp)):
                dp = self.dp_of(pp, tp)
                rows = _filter_rows(self.dp_rows(dp, tp), fixed)
                rows = _lean_rows(rows, expand) if lean else rows
                all_rc = self.recompute_choices(pp)
                rcs = values("recompute", lambda: all_rc, lambda: _lean_recompute(all_rc))
                rc = np.array([(RECOMPUTE_MODES.index(m), k) for m, k in rcs], dtype=np.int64)
                for mbs in values("micro_batch", lambda: self.mbs_choices(dp), lambda: [1]):
                    nmb = w.global_batch // (dp * mbs)
                    scheds = self.schedule_choices(pp, nmb)
                    for schedule, v in values("schedule", lambda: scheds, lambda: scheds):
                        split = self.table.add(pp, v, balanced_split(w.profile.num_layers, pp * v))
                        size = len(rows) * len(rc)
                        for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("mbs", mbs), ("nmb", nmb),
                                            ("schedule", SCHEDULES.index(schedule)), ("v", v),
                                            ("precision", precision), ("split", split)):
                            cols[name].append(np.full(size, value, dtype=np.int64))
                        for j, name in enumerate(INNER):
                            cols[name].append(np.repeat(rows[:, j], len(rc)))
                        cols["recompute"].append(np.tile(rc[:, 0], len(rows)))
                        cols["recompute_blocks"].append(np.tile(rc[:, 1], len(rows)))
                        outer = {"pp": pp, "tp": tp, "micro_batch": mbs, "schedule": (schedule, v)}
                        if expand in outer:
                            cand.append(np.full(size, index[outer[expand]]))
                        elif expand == "recompute":
                            cand.append(np.tile([index[r] for r in rcs], len(rows)))
                        else:
                            cand.append(np.repeat([index[_row_value(expand, r)] for r in rows], len(rc)))
        if not cand:
            return PlanArrays.empty(self.table), np.zeros(0, dtype=np.int64)
        a = {name: np.concatenate(parts) for name, parts in cols.items()}
        for name in ("zero", "comm", "order"):
            a[name] = a[name].astype(np.int64)
        for name in ("offload", "sp"):
            a[name] = a[name].astype(bool)
        return PlanArrays(**a, splits=self.table), np.concatenate(cand).astype(np.int64)

    def best_completion(self, prefix: tuple) -> tuple | None:
        """The knob values of the fastest fitting plan that starts with `prefix`, found
        exhaustively (the expert that labels off-path decisions in training); None if none fits."""
        if len(prefix) == len(KNOBS):
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
    @staticmethod
    def prefix_of(plan: Plan) -> tuple:
        """The knob values that stand for a plan of the space (the inverse of `plan`)."""
        return (plan.pp, plan.tp, plan.micro_batch_size, (plan.zero, plan.offload_optimizer),
                (plan.recompute, plan.recompute_blocks), plan.bucket_mb, (plan.schedule, plan.virtual_stages),
                plan.sequence_parallel, COMM_DTYPES.index(plan.grad_comm_dtype), MESH_ORDERS.index(plan.mesh_order))

    def plan(self, prefix: tuple) -> Plan:
        """The plan a complete sequence of choices stands for."""
        c = dict(zip(KNOBS, prefix))
        if len(c) != len(KNOBS):
            raise ValueError(f"a plan needs all {len(KNOBS)} knobs, got {len(c)}")
        dp = self.dp_of(c["pp"], c["tp"])
        zero, offload = c["zero"]
        (mode, blocks), (schedule, v) = c["recompute"], c["schedule"]
        return Plan(dp=dp, tp=c["tp"], pp=c["pp"], micro_batch_size=c["micro_batch"],
                    num_micro_batches=self.workload.global_batch // (dp * c["micro_batch"]),
                    mesh_order=MESH_ORDERS[c["mesh_order"]], zero=zero, bucket_mb=c["bucket"], recompute=mode,
                    recompute_blocks=blocks, schedule=schedule, virtual_stages=v,
                    sequence_parallel=c["sequence_parallel"], precision=self.workload.precision,
                    grad_comm_dtype=COMM_DTYPES[c["comm_dtype"]], offload_optimizer=offload)


def _row_value(knob: str, row: np.ndarray):
    """A data-parallel knob's value in a row of space._data_parallel_options."""
    if knob == "zero":
        return int(row[DP_COLUMNS["zero"][0]]), bool(row[DP_COLUMNS["zero"][1]])
    value = row[DP_COLUMNS[knob][0]]
    return {"bucket": float, "sequence_parallel": bool}.get(knob, int)(value)


def _filter_rows(rows: np.ndarray, fixed: dict) -> np.ndarray:
    keep = np.ones(len(rows), dtype=bool)
    for knob in DP_COLUMNS:
        if knob in fixed:
            keep &= np.array([_row_value(knob, r) == fixed[knob] for r in rows], dtype=bool)
    return rows[keep]


def _lean_rows(rows: np.ndarray, expand: str) -> np.ndarray:
    """Per ZeRO stage and offload (and value of the expanded knob), the row with the least memory:
    smallest bucket, narrowest gradient dtype, sequence parallel on (mesh order: memory-neutral)."""
    z, off = DP_COLUMNS["zero"]
    keys = [rows[:, z], rows[:, off]] + [rows[:, c] for c in DP_COLUMNS.get(expand, ())]
    comm_bytes = np.array([DTYPE_BYTES[d] for d in COMM_DTYPES])[rows[:, INNER.index("comm")].astype(int)]
    order = np.lexsort((rows[:, INNER.index("order")], -rows[:, INNER.index("sp")], comm_bytes,
                        rows[:, INNER.index("bucket_mb")]))
    _, first = np.unique(np.stack(keys, axis=1)[order], axis=0, return_index=True)
    return rows[np.sort(order[first])]


def _lean_recompute(choices: list) -> list:
    """The recompute settings among which the least activation memory lies: memory is monotone in
    the number of recomputed blocks, so the extremes of each mode suffice."""
    fulls = [c for c in choices if c[0] == "full"]
    return [c for c in choices if c[0] != "full"] + _unique(fulls[:1] + fulls[-1:])


def _unique(values: list) -> list:
    return list(dict.fromkeys(values))
