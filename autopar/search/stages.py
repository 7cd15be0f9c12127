"""The exact per-stage solver (issue 41): for a uniform outer plan, the layer split (with stages of no
block at the ends) and the per-stage recompute that minimise the cost model's iteration time with
every pipeline rank within the memory budget.

It follows the structure of the cost model's objective (autopar/cost/model.py): each pipeline rank's
time per micro-batch, its data-parallel tail (exposed gradient collectives and optimizer step) and its
peak memory depend only on the rank's position and its blocks (by kind, and how each is recomputed), and

    iteration = pipe(sum of the ranks' micro-batch times, the slowest rank's) + the largest tail + constants

with `pipe` (`model._schedule`) increasing in both. So a dynamic programme over the ranks in pipeline
order that keeps, for each number of blocks placed so far, the Pareto front of (sum, slowest, largest
tail) over the partial plans whose ranks fit finds an optimum: a partial plan dominated in all three
completes no better than the one that dominates it. Every rank candidate (position, blocks, their
recompute) is priced once, all in one `evaluate(..., ranks=True)` call over a `RankTable`: the same
functions that price whole plans, no second cost model.

Under 1F1B and GPipe (one stage per rank) the split and the recompute are both searched, and the first
and the last stage may hold no block (embedding-only, head-only). Under the interleaved schedule a
rank's figures depend on all its chunks together, which the DP over stages cannot carry: there the
split stays balanced and every rank's pattern of per-chunk recompute is searched exactly (up to
MAX_PATTERNS patterns per rank; beyond, and under other schedules, the plan is not solved: None).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost.arrays import RankTable
from autopar.knobs import balanced_split, knob
from autopar.plan import Plan

SOLVED_SCHEDULES = ("gpipe", "1f1b", "interleaved")
MAX_PATTERNS = 4096  # per-chunk recompute patterns of one rank under the interleaved schedule


@dataclass(frozen=True)
class Solved:
    plan: Plan  # the outer plan with its layer split and stage_recompute
    iteration_time: float  # evaluate's, of the whole plan
    fits: bool  # evaluate's (always: every rank was within the budget)


def stage_options(n: int, selective: bool) -> list[str]:
    """A stage of n blocks: no recompute, selective (where the model has an attention core to drop), or
    full recompute of its first K blocks, K = 1 ... n. A stage of no block recomputes nothing."""
    if n == 0:
        return ["none"]
    return ["none"] + (["selective"] if selective else []) + [f"full:{k}" for k in range(1, n + 1)]


def outer_of(plan: Plan) -> Plan:
    """The uniform plan the solver starts from: its recompute and split left to the solver."""
    return plan.with_(recompute="none", recompute_blocks=0, stage_recompute=(), layer_split=())


def solvable(plan: Plan) -> bool:
    return plan.schedule in SOLVED_SCHEDULES


class _Candidates:
    """Rank candidates of a batch of outer plans, gathered in bulk for one evaluate call."""

    def __init__(self, n_kinds: int):
        self.n_kinds = n_kinds
        self.outer, self.rank, self.counts, self.full, self.sel = [], [], [], [], []

    def add(self, outer: int, rank: int, counts: np.ndarray, full: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Rows for `len(full)` candidates of one rank with the same blocks (`counts`); their indices."""
        start = sum(len(r) for r in self.rank)
        n = len(full)
        self.outer.append(np.full(n, outer))
        self.rank.append(np.full(n, rank))
        self.counts.append(np.broadcast_to(counts, (n, self.n_kinds)))
        self.full.append(full)
        self.sel.append(sel)
        return np.arange(start, start + n)

    def arrays(self):
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros((0, self.n_kinds))  # noqa: E731
        return (np.concatenate(self.outer).astype(np.int64), np.concatenate(self.rank),
                cat(self.counts), cat(self.full), cat(self.sel))


class _Problem:
    """One outer plan: its rank candidates (rows) and how they combine."""

    def __init__(self, workload, plan: Plan, selective: bool, cum: np.ndarray, kinds: np.ndarray):
        self.plan, self.pp, self.v = plan, plan.pp, plan.virtual_stages
        self.layers = len(kinds)
        self.selective = selective
        self.cum, self.kinds = cum, kinds
        self.moves: list[dict] = []  # per rank: (from, to) blocks placed -> [(row, choice)]

    def ends(self, rank: int) -> np.ndarray:
        e = np.zeros(self.cum.shape[1])
        e[0] += rank == 0
        e[-1] += rank == self.pp - 1
        return e

    def build(self, cands: _Candidates, index: int) -> bool:
        return self._build_looped(cands, index) if self.v == 1 else self._build_interleaved(cands, index)

    def _range(self, a: int, n: int, options: list[str]):
        """Blocks [a, a + n) and, per option, those fully and selectively recomputed (by kind)."""
        cum = self.cum
        held = cum[a + n] - cum[a]
        full = np.array([cum[a + (int(o[5:]) if o.startswith("full:") else 0)] - cum[a] for o in options])
        sel = np.array([held if o == "selective" else 0 * held for o in options])
        return held, full, sel

    def _build_looped(self, cands: _Candidates, index: int) -> bool:
        pp, L = self.pp, self.layers
        seq_rows: dict = {}  # (rank, blocks' kinds) -> (rows, options): ranks alike price alike
        for r in range(pp):
            moves: dict = {}
            for a in range(L + 1):
                for n in range(L - a + 1):
                    if not self._feasible(r, a, n):
                        continue
                    key = (r, self.kinds[a:a + n].tobytes())
                    if key not in seq_rows:
                        options = stage_options(n, self.selective)
                        held, full, sel = self._range(a, n, options)
                        rows = cands.add(index, r, held + self.ends(r), full, sel)
                        seq_rows[key] = (rows, [(n, o) for o in options])
                    moves[(a, a + n)] = seq_rows[key]
            self.moves.append(moves)
        return True

    def _feasible(self, r: int, a: int, n: int) -> bool:
        """Rank r holding blocks [a, a + n): every rank before it and after it can still hold its share (a
        block each; the first and the last none, with a pipeline)."""
        pp, L = self.pp, self.layers
        if pp == 1:
            return a == 0 and n == L
        end_ok = r in (0, pp - 1)
        if n == 0 and not end_ok:
            return False
        if r == 0 and a != 0 or r == pp - 1 and a + n != L:
            return False
        before = max(r - 1, 0)  # ranks 1 .. r-1 hold a block each
        after = max(pp - r - 2, 0)  # ranks r+1 .. pp-2 hold a block each
        return a >= before and L - a - n >= after

    def _build_interleaved(self, cands: _Candidates, index: int) -> bool:
        pp, v = self.pp, self.v
        split = balanced_split(self.layers, pp * v)
        starts = np.concatenate([[0], np.cumsum(split)])
        for r in range(pp):
            stages = list(range(r, pp * v, pp))
            per_stage = [stage_options(split[s], self.selective) for s in stages]
            if np.prod([len(o) for o in per_stage], dtype=float) > MAX_PATTERNS:
                return False
            held = sum(self.cum[starts[s + 1]] - self.cum[starts[s]] for s in stages)
            ranges = [self._range(int(starts[s]), split[s], o) for s, o in zip(stages, per_stage)]
            patterns, fulls, sels = [], [], []
            for combo in itertools.product(*[range(len(o)) for o in per_stage]):
                patterns.append(tuple(per_stage[i][j] for i, j in enumerate(combo)))
                fulls.append(sum(ranges[i][1][j] for i, j in enumerate(combo)))
                sels.append(sum(ranges[i][2][j] for i, j in enumerate(combo)))
            rows = cands.add(index, r, held + self.ends(r), np.array(fulls), np.array(sels))
            self.moves.append({(0, 0): (rows, patterns)})
        return True


def _front(b, s, m, t) -> np.ndarray:
    """Indices of the points not dominated in (s, m, t) among those with the same b (ties: the first kept)."""
    order = np.lexsort((t, m, s, b))
    keep = []
    bounds = np.flatnonzero(np.diff(b[order])) + 1
    for group in np.split(order, bounds):
        gm, gt = m[group], t[group]
        # sorted by s: a point is dominated when an earlier one has m and t no larger
        dominated = np.triu((gm[:, None] <= gm[None, :]) & (gt[:, None] <= gt[None, :]), k=1).any(axis=0)
        keep.append(group[~dominated])
    return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)


def _solve_one(problem: _Problem, per_mb, tail, fits):
    """The DP over ranks: (blocks placed, sum, slowest, largest tail, parent, choice) per rank, Pareto-pruned."""
    b, s, m, t = (np.zeros(1) for _ in range(4))
    layers = []
    reduced: dict = {}  # the options of a rank's blocks that fit and are not dominated in (time, tail)
    for moves in problem.moves:
        src_b, dst_b, p, tl, choice = [], [], [], [], []
        for (a, end), (rows, choices) in moves.items():
            if id(rows) not in reduced:
                ok = rows[fits[rows]]
                front = _front(np.zeros(len(ok)), per_mb[ok], tail[ok], np.zeros(len(ok)))
                reduced[id(rows)] = [(int(ok[j]), choices[int(np.flatnonzero(rows == ok[j])[0])]) for j in front]
            for row, pick in reduced[id(rows)]:
                src_b.append(a)
                dst_b.append(end)
                p.append(per_mb[row])
                tl.append(tail[row])
                choice.append(pick)
        if not src_b:
            return None
        src_b, dst_b, p, tl = map(np.asarray, (src_b, dst_b, p, tl))
        # join every point with every move from its block count
        pair_pt, pair_mv = np.nonzero(b[:, None] == src_b[None, :])
        if len(pair_pt) == 0:
            return None
        nb, ns = dst_b[pair_mv], s[pair_pt] + p[pair_mv]
        nm, nt = np.maximum(m[pair_pt], p[pair_mv]), np.maximum(t[pair_pt], tl[pair_mv])
        keep = _front(nb, ns, nm, nt)
        layers.append((pair_pt[keep], [choice[i] for i in pair_mv[keep]]))
        b, s, m, t = nb[keep], ns[keep], nm[keep], nt[keep]
    done = np.flatnonzero(b == (problem.layers if problem.v == 1 else 0))
    return (done, layers) if len(done) else None


def _trace(layers, point: int) -> list:
    choices = []
    for parents, picks in reversed(layers):
        choices.append(picks[point])
        point = int(parents[point])
    return choices[::-1]


def solve(workload, plans: list[Plan], coeffs: Coefficients | None = None) -> list[Solved | None]:
    """Per outer plan (its recompute and split are ignored), the best per-stage plan in memory, or None
    (nothing fits, or the schedule is not solved here)."""
    c = coeffs if coeffs is not None else Coefficients.for_cluster(workload.cluster, workload.runtime)
    profile = workload.profile
    kinds = np.array([k for k, e in enumerate(profile.layers, start=1) for _ in range(e.count)], dtype=np.int64)
    n_kinds = len(profile.blocks)
    cum = np.vstack([np.zeros(n_kinds), np.cumsum(np.eye(n_kinds)[kinds], axis=0)])
    selective = {}
    problems: list[_Problem | None] = []
    cands = _Candidates(n_kinds)
    for i, plan in enumerate(plans):
        outer = outer_of(plan)
        if not solvable(outer):
            problems.append(None)
            continue
        if outer.pp not in selective:
            selective[outer.pp] = any(mode == "selective" for mode, _ in knob("recompute").choices(
                workload, {"pp": outer.pp}))
        problem = _Problem(workload, outer, selective[outer.pp], cum, kinds)
        problems.append(problem if problem.build(cands, i) else None)
    out: list[Solved | None] = [None] * len(plans)
    if not cands.rank:
        return out
    outer_idx, ranks, counts, full, sel = cands.arrays()
    base = PlanArrays.from_plans([p.plan if p else outer_of(plans[0]) for p in problems], profile)
    pa = PlanArrays({name: col[outer_idx] for name, col in base.columns.items() if name != "split"}
                    | {"split": np.arange(len(ranks))}, RankTable(ranks, counts, full, sel))
    res = evaluate(workload, pa, c, ranks=True)
    per_mb, tail = res["rank_per_mb"][:, 0], res["rank_tail"][:, 0]
    fits = res["rank_memory"][:, 0] <= workload.memory_budget
    # the last front of each plan: its points, whole plans, priced by evaluate itself (pipe's formula
    # is the schedule's own); the least is the optimum
    finals, owner = [], []
    for i, problem in enumerate(problems):
        found = None if problem is None else _solve_one(problem, per_mb, tail, fits)
        if found is None:
            continue
        points, layers = found
        for point in points:
            finals.append(_plan_of(problem, _trace(layers, int(point))))
            owner.append(i)
    if finals:
        res = evaluate(workload, PlanArrays.from_plans(finals, profile), c)
        times, owner = res["iteration_time"], np.array(owner)
        for i in np.unique(owner):
            rows = np.flatnonzero(owner == i)
            best = int(rows[np.argmin(times[rows])])
            out[i] = Solved(finals[best], float(times[best]), bool(res["fits"][best]))
    return out


def _plan_of(problem: _Problem, choices: list) -> Plan:
    """The per-stage plan of one choice per rank: (blocks, recompute) under 1F1B / GPipe, a pattern of
    per-chunk recompute under the interleaved schedule."""
    plan = problem.plan
    if problem.v == 1:
        split = tuple(n for n, _ in choices)
        entries = tuple(e for _, e in choices)
    else:
        split = balanced_split(problem.layers, problem.pp * problem.v)
        entries = [""] * len(split)
        for r, pattern in enumerate(choices):
            for j, e in enumerate(pattern):
                entries[r + j * problem.pp] = e
        entries = tuple(entries)
    if all(split) and split == balanced_split(problem.layers, len(split)):
        split = ()
    if all(e == "none" for e in entries):
        entries = ()
    return plan.with_(layer_split=split, stage_recompute=entries)
