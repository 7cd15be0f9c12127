"""The oracle: every plan of the space through the vectorised cost model, in chunks."""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar import axes
from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.errors import NoValidPlanError
from autopar.knobs import knobs
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.search.simplicity import simplest_first, tie_buckets
from autopar.search.space import degree_choices, enumerate_plans

CHUNK = 1 << 17


def structure_fields() -> list[str]:
    """The fields that make plans distinct alternatives (every knob but the data-parallel details)."""
    return [f.name for k in knobs() if not k.detail for f in k.fields]


def distinct(pa: PlanArrays, order, k: int, fields: list[str] | None = None, accept=None,
             seen: set | None = None) -> list[int]:
    """The first k rows in `order` whose structure (`fields`, default `structure_fields()`) no
    earlier row nor `seen` has, among those `accept(row)` takes (default: all)."""
    names = fields or structure_fields()
    chosen, seen = [], set() if seen is None else seen
    for i in order:
        if len(chosen) >= k:
            break
        key = tuple(float(pa.columns[f][i]) for f in names)
        if key not in seen and (accept is None or accept(int(i))):
            seen.add(key)
            chosen.append(int(i))
    return chosen


class ExhaustivePlanner(Planner):
    name = "exhaustive"

    def __init__(self, coeffs: Coefficients | None = None):
        super().__init__()
        self.coeffs = coeffs

    def propose(self, workload, k: int = 1) -> list[Plan]:
        pa, _ = self.ranked(workload, k)
        return [pa.plan(i) for i in range(len(pa))]

    def ranked(self, workload, k: int) -> tuple[PlanArrays, dict[str, np.ndarray]]:
        """The k best plans that fit, with their cost-model results, best first. Plans within
        0.5% (simplicity.TIE) of each other count as ties, broken towards the simplest plan, and a plan that
        differs from a better one only in a data-parallel detail (ZeRO, buckets, gradient
        dtype, offload, mesh order) is left out, so the runners-up are real alternatives."""
        space = enumerate_plans(workload)
        self.evaluations = len(space)
        if len(space) == 0:
            raise no_plan_error(workload)
        keep_per_chunk = max(64, 32 * k)
        rows, least_memory = [], np.inf
        for start in range(0, len(space), CHUNK):
            index = np.arange(start, min(start + CHUNK, len(space)))
            res = evaluate(workload, space.take(index), self.coeffs)
            least_memory = min(least_memory, float(res["peak_memory"].min()))
            fit = np.flatnonzero(res["fits"])
            rows.append(index[fit[np.argsort(res["iteration_time"][fit], kind="stable")[:keep_per_chunk]]])
        rows = np.concatenate(rows)
        if len(rows) == 0:
            raise memory_error(workload, least_memory)
        shortlist = space.take(rows)
        times = evaluate(workload, shortlist, self.coeffs)["iteration_time"]
        # only the tie buckets down to the k-th distinct structure can hold the answer: those become Plans
        buckets, seen, names = tie_buckets(times), set(), structure_fields()
        for i in np.argsort(times, kind="stable"):
            seen.add(tuple(float(shortlist.columns[f][i]) for f in names))
            if len(seen) == k:
                break
        band = np.flatnonzero(buckets <= buckets[i])
        plans = [shortlist.plan(int(j)) for j in band]
        order = [band[j] for j in simplest_first(plans, times[band])]
        best = shortlist.take(np.array(distinct(shortlist, order, k)))
        return best, evaluate(workload, best, self.coeffs)


def no_plan_error(workload) -> NoValidPlanError:
    """Explain why the space is empty: the batch admits no data-parallel degree, or the GPU count
    cannot be split into tensor x pipeline degrees the model allows."""
    n, batch = workload.world_size, workload.global_batch
    held = getattr(workload, "fixed", ())
    if held and degree_choices(dataclasses.replace(workload, fixed=())):  # `--fix` emptied it
        return NoValidPlanError(f"no plan for global batch {batch} on {n} GPUs has "
                                + ", ".join(f"{name}={value}" for name, value in held))
    if not degree_choices(workload):

        dp = axes.derived_axis()  # the degrees the other axes allow, whatever the batch
        dps = sorted({d[dp] for d in axes.feasible_degrees(workload, unchecked=(dp,))})
        return NoValidPlanError(
            f"global batch {batch} is not divisible by any data-parallel degree possible on {n} GPUs "
            f"(dp must be one of {dps}); use a global batch that is a multiple of {dps[0]}")
    return NoValidPlanError(f"no plan for global batch {batch} on {n} GPUs")


def memory_error(workload, least_bytes: float) -> NoValidPlanError:
    gpu = workload.cluster.gpu
    need_gpus = int(np.ceil(workload.world_size * least_bytes / workload.memory_budget))
    return NoValidPlanError(
        f"{workload.profile.name} fits no plan on {workload.world_size} x {gpu.name}: the leanest plan needs "
        f"{least_bytes / 1e9:.1f} GB per GPU but {workload.memory_budget / 1e9:.1f} GB of a GPU's "
        f"{gpu.memory_bytes / 1e9:.0f} GB are usable (memory headroom {workload.memory_headroom:.0%}); use about "
        f"{need_gpus} or more GPUs, GPUs with more memory, or a smaller global batch")
