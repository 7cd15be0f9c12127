"""Knob-by-knob walks of the plan space, shared by the sampling planners (random, Optuna).

A walk picks one knob at a time from the choices that `space` allows given the earlier picks,
so every plan it returns is a plan of the space, without enumerating the space. Each choice
has a numeric position on its knob, and each knob a fixed `universe` of the positions it can
take in the workload: a search that needs fixed distributions (Optuna) suggests a position in
the universe and takes the valid choice nearest to it, so near positions mean similar plans.
Knobs whose range depends on earlier picks are placed by their share of that range (pipeline
degree: log pp / log(GPUs / tp); micro-batch: log mbs / log(batch / dp); recompute: blocks /
blocks of the busiest rank): an absolute position would send every suggestion beyond the
range to its end, and most walks to the same plans (all to dp = 1, for instance).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autopar.cost import PlanArrays, evaluate
from autopar.cost.arrays import MESH_ORDERS
from autopar.errors import NoValidPlanError
from autopar.plan import COMM_DTYPES, RECOMPUTE_MODES, Plan
from autopar.search.exhaustive import STRUCTURE, no_plan_error
from autopar.search.simplicity import simpler_variants, simplest_first, tie_buckets
from autopar.search.space import (
    INNER,
    MAX_VIRTUAL_STAGES,
    _data_parallel_options,
    degree_choices,
    micro_batch_choices,
    recompute_choices,
    schedule_choices,
)

SCHEDULES_IN_ORDER = [("gpipe", 1), ("1f1b", 1)] + [("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1)]
KNOBS = ("tp", "pp_share", "micro_batch_share", "schedule", "recompute", "recompute_share") + INNER

# (knob name, positions of the valid choices) -> index of the chosen one
Chooser = Callable[[str, np.ndarray], int]


class KnobSpace:
    """The plan space of one workload, walked one knob at a time."""

    def __init__(self, workload):
        self.workload = workload
        self.degrees = degree_choices(workload)
        if not self.degrees:
            raise no_plan_error(workload)
        self.universe = self._universe()

    def sample(self, choose: Chooser) -> Plan:
        """One plan of the space, every knob picked by `choose` among its valid choices."""
        w = self.workload
        tp = _pick(choose, "tp", sorted({t for _, t, _ in self.degrees}), np.log2)
        dp, _, pp = _pick(choose, "pp_share", [d for d in self.degrees if d[1] == tp],
                          lambda d: _share(d[2], d[0] * d[2]))
        mbs = _pick(choose, "micro_batch_share", micro_batch_choices(w, dp),
                    lambda m: _share(m, w.global_batch // dp))
        nmb = w.global_batch // (dp * mbs)
        schedule, v = _pick(choose, "schedule", schedule_choices(w, pp, nmb), SCHEDULES_IN_ORDER.index)
        recompute = recompute_choices(w, pp, v)
        mode = _pick(choose, "recompute", sorted({m for m, _ in recompute}, key=RECOMPUTE_MODES.index),
                     RECOMPUTE_MODES.index)
        blocks = 0
        if mode == "full":
            counts = [n for m, n in recompute if m == "full"]
            blocks = _pick(choose, "recompute_share", counts, lambda n: n / counts[-1])
        rows = _data_parallel_options(w, dp, tp)
        for j, name in enumerate(INNER):
            values = np.unique(rows[:, j])
            rows = rows[rows[:, j] == values[choose(name, values)]]
        zero, bucket_mb, comm, offload, order, sp = rows[0]
        return Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb,
                    mesh_order=MESH_ORDERS[int(order)], zero=int(zero), bucket_mb=float(bucket_mb),
                    recompute=mode, recompute_blocks=blocks, schedule=schedule, virtual_stages=v,
                    sequence_parallel=bool(sp), precision=w.precision, grad_comm_dtype=COMM_DTYPES[int(comm)],
                    offload_optimizer=bool(offload))

    def _universe(self) -> dict[str, np.ndarray]:
        """Every position each knob can take in this workload; a superset for the knobs whose
        exact set would need the enumeration (a position never valid maps to a neighbour)."""
        w, layers = self.workload, self.workload.profile.num_layers
        recompute_shares = set()
        for pp in {p for _, _, p in self.degrees}:
            for v in range(1, min(MAX_VIRTUAL_STAGES, layers // pp) + 1):
                counts = [n for m, n in recompute_choices(w, pp, v) if m == "full"]
                recompute_shares |= {n / counts[-1] for n in counts}
        everything = _data_parallel_options(w, 2, max(t for _, t, _ in self.degrees))
        out = {
            "tp": np.log2(sorted({t for _, t, _ in self.degrees})),
            "pp_share": sorted({_share(pp, dp * pp) for dp, _, pp in self.degrees}),
            "micro_batch_share": sorted({_share(m, w.global_batch // dp) for dp in {d for d, _, _ in self.degrees}
                                         for m in micro_batch_choices(w, dp)}),
            "schedule": np.arange(len(SCHEDULES_IN_ORDER)),
            "recompute": np.arange(len(RECOMPUTE_MODES)),
            "recompute_share": sorted(recompute_shares),
        }
        out.update({name: np.unique(everything[:, j]) for j, name in enumerate(INNER)})
        return {name: np.asarray(out[name], dtype=float) for name in KNOBS}


def _share(x: int, whole: int) -> float:
    """Where x lies between 1 and whole on a log scale, in [0, 1]."""
    return float(np.log(x) / np.log(whole)) if whole > 1 else 0.0


def _pick(choose: Chooser, name: str, options: list, position: Callable):
    return options[choose(name, np.array([position(o) for o in options], dtype=float))]


def nearest(positions: np.ndarray, target: float) -> int:
    """The valid choice closest to a suggested position (the lower one on a tie)."""
    return int(np.argmin(np.abs(positions - target)))


def best_distinct(workload, plans: list[Plan], result: dict, k: int, method: str) -> tuple[list[Plan], int]:
    """The k fastest plans that fit, best first (the simplest first among ties), skipping any that
    repeats a better plan's structure (it differs only in a data-parallel detail), as the oracle does;
    and the cost-model evaluations spent on the simpler variants of the best plans, which the
    sampler may not have drawn."""
    fit = np.flatnonzero(result["fits"])
    if len(fit) == 0:
        raise sample_memory_error(workload, method, len(plans), float(np.min(result["peak_memory"])))
    fitted = [plans[i] for i in fit]
    times = np.asarray(result["iteration_time"], dtype=float)[fit]
    tried = set(plans)
    # the k fastest, and every plan tied with the fastest: the simplest of the tie is returned, so its
    # simpler variants must have been tried too
    best = dict.fromkeys([*np.argsort(times, kind="stable")[:k], *np.flatnonzero(tie_buckets(times) == 0)])
    extra = list(dict.fromkeys(v for i in best for v in simpler_variants(workload, fitted[i]) if v not in tried))
    if extra:
        res = evaluate(workload, PlanArrays.from_plans(extra, workload.profile))
        fitted += [p for p, ok in zip(extra, res["fits"]) if ok]
        times = np.concatenate([times, res["iteration_time"][res["fits"]]])
    pa = PlanArrays.from_plans(fitted, workload.profile)
    chosen, seen = [], set()
    for i in simplest_first(fitted, times):
        key = tuple(int(getattr(pa, f)[i]) for f in STRUCTURE)
        if key not in seen:
            seen.add(key)
            chosen.append(fitted[i])
        if len(chosen) == k:
            break
    return chosen, len(extra)


def sample_memory_error(workload, method: str, tried: int, least_bytes: float) -> NoValidPlanError:
    """Unlike the oracle, a sampler that found nothing cannot say that nothing fits."""
    gpu = workload.cluster.gpu
    return NoValidPlanError(
        f"none of the {tried} plans {method} tried for {workload.profile.name} fits on {workload.world_size} x "
        f"{gpu.name}: the leanest needs {least_bytes / 1e9:.1f} GB per GPU but {workload.memory_budget / 1e9:.1f} GB "
        f"are usable; use more --trials, or --method exhaustive to check every plan")
