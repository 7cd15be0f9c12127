"""The exhaustive search's pricing of the uniform plans: every plan without recompute is priced, and a plan
with recompute only where its bound says it could matter.

A plan that recomputes runs every micro-batch of every rank the plan without recompute runs (its sibling:
the same plan but for `recompute` and `recompute_blocks`), and more: its pipeline time (the schedule over
the ranks' micro-batch times), step overhead and exposed context-parallel exchange are at least its
sibling's, its exposed data-parallel collectives at least 0 and its optimizer step at least the least of
any rank's. So its iteration time is at least its sibling's less the sibling's exposed data-parallel time
and its step on the tail rank, plus the least rank's step (`floor_of`). Most of a space recomputes (GPT-3
175B on 128 DGX A100: 1,763,168 of 1,876,080 plans) and most of those siblings are slow, so the search
prices the plans in the order of their floors and stops where no plan left could be among the answers
(`PricedSpace.cutoff`): the k best distinct plans with their tie band, and the outer plans of the fastest uniform
plans that the per-stage solver tries first. The floor is a fact of the cost model's structure, not an
estimate: tests/test_exhaustive_pricing.py checks it on every plan of six spaces (every schedule kind, both
runtimes, fp8, context and expert parallelism) and that the search answers as when it prices every plan."""

from __future__ import annotations

import numpy as np

from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost.arrays import unique_rows
from autopar.knobs import RECOMPUTE_MODES, knobs
from autopar.search.simplicity import bucket_end
from autopar.search.stages import worth_solving

RECOMPUTE_FIELDS = ("recompute", "recompute_blocks")


def outer_groups(space: PlanArrays) -> np.ndarray:
    """Each plan's outer plan (every column but recompute's), as a group index."""
    _, group = unique_rows([v for name, v in space.columns.items() if name not in RECOMPUTE_FIELDS])
    return np.asarray(group).reshape(-1)


def floor_of(res: dict) -> np.ndarray:
    """From `evaluate`'s results of plans without recompute, the least iteration time of each with any recompute
    (module doc): its time less its exposed data-parallel collectives and tail rank's optimizer step, plus the
    least rank's step (`rank_optimizer`, where the results have the ranks; else none)."""
    least_step = res["rank_optimizer"].min(axis=1) if "rank_optimizer" in res else 0.0
    return res["iteration_time"] - res["dp_comm"] - res["optimizer"] + least_step


def structure_fields() -> list[str]:
    """The fields that make plans distinct alternatives (every knob but the data-parallel details)."""
    return [f.name for k in knobs() if not k.detail for f in k.fields]


def kth_distinct(columns: dict, times: np.ndarray, k: int) -> int | None:
    """The index (into `times` and the `columns` of the same plans) of the plan at which, in time order (ties
    in given order), the k-th distinct structure (`structure_fields`) first appears; None with fewer."""
    order = np.argsort(times, kind="stable")
    _, ident = unique_rows([np.asarray(columns[f])[order] for f in structure_fields()])
    _, first = np.unique(np.asarray(ident).reshape(-1), return_index=True)
    return int(order[np.sort(first)[k - 1]]) if len(first) >= k else None


class PricedSpace:
    """Iteration time, peak memory and fit of the plans of `space` that could be among the answers (inf, nan
    and False for the rest), and, with `ranks`, what the per-stage bound reads of the plans without recompute
    (`stages.lower_bound`). The search reads the plans that fit chunk by chunk, as it always has (`chunks`: ties
    in space order, at most `keep` plans and `outers` outer plans a chunk); `k`: the distinct plans it asks for;
    `promising`: how many outer plans of the fastest uniform plans the per-stage search tries first (0: none)."""

    def __init__(self, workload, space: PlanArrays, coeffs: Coefficients | None, chunk: int, k: int, keep: int,
                 ranks: bool = False, promising: int = 0, outers: int = 0, prune: bool = True):
        n = len(space)
        self.workload, self.space, self.coeffs, self.chunk = workload, space, coeffs, chunk
        self.k, self.keep, self.promising, self.outers = k, keep, promising, outers
        self.time, self.memory = np.full(n, np.inf), np.full(n, np.nan)
        self.fits, self.count = np.zeros(n, dtype=bool), 0  # count: plans priced
        self.group = outer_groups(space)
        plain = np.flatnonzero(space.recompute == RECOMPUTE_MODES.index("none"))
        self.ranked: list[tuple[np.ndarray, dict]] = []  # (plain rows, their evaluate(..., ranks=True))
        self._worth: dict[int, bool] = {}
        floors = np.full(int(self.group.max()) + 1 if n else 0, -np.inf)
        for start in range(0, len(plain), chunk):
            rows = plain[start:start + chunk]
            res = self._price(rows, ranks)
            if ranks:
                self.ranked.append((rows, res))
            floors[self.group[rows]] = floor_of(res)
        rest = np.ones(n, dtype=bool)
        rest[plain] = False
        rest = np.flatnonzero(rest)
        floor = floors[self.group[rest]]  # -inf without a sibling: always priced
        order = np.argsort(floor, kind="stable")
        rest, floor = rest[order], floor[order]
        position = 0
        while position < len(rest):
            cut = self.cutoff() if prune else np.inf
            end = min(position + chunk, int(np.searchsorted(floor, cut, side="right")))
            if end <= position:
                break
            self._price(np.sort(rest[position:end]), False)
            position = end

    def _price(self, rows: np.ndarray, ranks: bool) -> dict:
        res = evaluate(self.workload, self.space.take(rows), self.coeffs, ranks=ranks)
        self.time[rows], self.memory[rows], self.fits[rows] = res["iteration_time"], res["peak_memory"], res["fits"]
        self.count += len(rows)
        return res

    def chunks(self):
        """Per chunk of the space, its plans that fit, fastest first (ties in space order): (the first `keep`,
        the fastest of each of its first `outers` outer plans), as rows of the space."""
        for start in range(0, len(self.space), self.chunk):
            fit = start + np.flatnonzero(self.fits[start:start + self.chunk])
            by_time = fit[np.argsort(self.time[fit], kind="stable")]
            _, first = np.unique(self.group[by_time], return_index=True)
            yield by_time[:self.keep], by_time[np.sort(first)[:self.outers]]

    def shortlist(self) -> tuple[np.ndarray, np.ndarray]:
        """Every chunk's first `keep` plans that fit and the fastest plan of each of its first `outers` outer
        plans, rows of the space."""
        firsts, fastest = zip(*self.chunks()) if len(self.space) else ((), ())
        joined = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
        return joined(firsts), joined(fastest)

    def cutoff(self) -> float:
        """A time past which no plan changes what the search reads (`shortlist`): inf until some plan fits, then
        the larger of the end of the tie band that holds the shortlist's k-th distinct structure
        (`simplicity.tie_buckets`) and the time of the `promising`-th outer plan worth solving among the chunks'
        fastest; with fewer known, the time of the last outer plan each chunk keeps (inf where a chunk keeps
        fewer than `outers`: a slower plan could still join it). A plan past it is slower than all the search
        reads and joins no list it reads, so pricing it would change nothing."""
        parts = list(self.chunks())
        rows = np.concatenate([first for first, _ in parts])
        if len(rows) == 0:
            return np.inf
        times = self.time[rows]
        kth = kth_distinct({f: self.space.columns[f][rows] for f in structure_fields()}, times, self.k)
        if kth is None:
            return np.inf
        cut = bucket_end(float(times.min()), float(times[kth]))
        if not self.promising:
            return cut
        leads = self.promising_rows(np.concatenate([fastest for _, fastest in parts]))
        if len(leads) == self.promising:
            return max(cut, float(self.time[leads[-1]]))
        kept = [self.time[fastest[-1]] if len(fastest) == self.outers else np.inf for _, fastest in parts]
        return max(cut, float(max(kept)))

    def promising_rows(self, fastest: np.ndarray) -> list[int]:
        """Of the chunks' fastest plans of their outer plans (`shortlist`), fastest first, the first of each of
        the first `promising` outer plans worth solving (`stages.worth_solving`)."""
        seen: dict[int, int] = {}
        for i in fastest[np.argsort(self.time[fastest], kind="stable")].tolist():
            if len(seen) == self.promising:
                break
            if self.group[i] not in seen and self._worth_solving(i):
                seen[int(self.group[i])] = i
        return list(seen.values())

    def _worth_solving(self, row: int) -> bool:
        g = int(self.group[row])
        if g not in self._worth:
            self._worth[g] = worth_solving(self.space.plan(row), self.workload.profile)
        return self._worth[g]
