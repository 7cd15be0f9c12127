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
from autopar.knobs import SCHEDULES, balanced_split, knob
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

    def __init__(self, n_kinds: int, start: int = 0):
        self.n_kinds, self.start, self.size = n_kinds, start, 0
        self.outer, self.rank, self.counts, self.full, self.sel = [], [], [], [], []

    def add(self, outer: int, rank: int, counts: np.ndarray, full: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Rows for `len(full)` candidates of one rank with the same blocks (`counts`); their indices."""
        start, n = self.start + self.size, len(full)
        self.size += n
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


@dataclass
class _Options:
    """A rank's blocks and the recompute options priced for them (rows of the candidates)."""

    rows: list
    choices: list  # (blocks, stage_recompute entry) per row
    one_kind: tuple | None  # (rank, first block, blocks, blocks by kind) of a range of one kind (`refine`)


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
        seq_rows: dict = {}  # (rank, blocks' kinds) -> its options: ranks alike price alike
        for r in range(self.pp):
            moves: dict = {}
            for a, n in self._ranges(r):
                key = (r, self.kinds[a:a + n].tobytes())
                if key not in seq_rows:
                    options = stage_options(n, self.selective)
                    one_kind = n > 3 and bool((self.kinds[a:a + n] == self.kinds[a]).all())
                    if one_kind:  # full:1 and full:n first; the least K that fits is found from them (`_refine`)
                        options = [o for o in options if not o.startswith("full:")] + ["full:1", f"full:{n}"]
                    held, full, sel = self._range(a, n, options)
                    rows = cands.add(index, r, held + self.ends(r), full, sel)
                    seq_rows[key] = _Options(list(rows), [(n, o) for o in options],
                                             (r, a, n, held) if one_kind else None)
                moves[(a, a + n)] = seq_rows[key]
            self.moves.append(moves)
        return True

    def _ranges(self, r: int):
        """(first block, blocks) rank r may hold: every rank before and after it can still hold its share
        (a block each; the first and the last none, with a pipeline)."""
        pp, L = self.pp, self.layers
        if pp == 1:
            yield 0, L
            return
        lo_a, hi_end = (0 if r == 0 else max(r - 1, 0)), L - max(pp - r - 2, 0)
        for a in range(lo_a, (0 if r == 0 else L) + 1):
            lo_n = 0 if r in (0, pp - 1) else 1
            ends = [L] if r == pp - 1 else range(a + lo_n, hi_end + 1)
            for end in ends:
                if end - a >= lo_n:
                    yield a, end - a

    def refine(self, cands: _Candidates, index: int, memory: np.ndarray, budget: float, everything: bool) -> None:
        """A second look at the ranks of one block kind priced at full:1 and full:n only. Their memory falls
        and their time grows with K (a recomputed block keeps its output instead of its activations; its
        forward runs again), so only the least K that fits can be in an optimum: estimated between the two
        (memory is affine in K), then priced with K - 1 to confirm (`everything`: every K, when it did not)."""
        for moves in self.moves:
            for opts in {id(o): o for o in moves.values()}.values():
                if opts.one_kind is None:
                    continue
                r, a, n, held = opts.one_kind
                priced = {o: row for row, (_, o) in zip(opts.rows, opts.choices)}
                m1, mn = memory[priced["full:1"]], memory[priced[f"full:{n}"]]
                if m1 <= budget or mn > budget:
                    continue
                if everything:
                    ks = range(2, n)
                else:
                    k = int(np.clip(np.ceil(1 + (m1 - budget) / (m1 - mn) * (n - 1)), 2, n))
                    ks = (k - 1, k)
                new = [f"full:{k}" for k in ks if f"full:{k}" not in priced]
                if new:
                    _, full, sel = self._range(a, n, new)
                    opts.rows += list(cands.add(index, r, held + self.ends(r), full, sel))
                    opts.choices += [(n, o) for o in new]

    def confirmed(self, memory: np.ndarray, budget: float) -> bool:
        """Whether each refined rank's least fitting K is priced: K fits and K - 1 does not."""
        for moves in self.moves:
            for opts in moves.values():
                if opts.one_kind is None:
                    continue
                fit = sorted(int(o[5:]) for row, (_, o) in zip(opts.rows, opts.choices)
                             if o.startswith("full:") and memory[row] <= budget)
                priced = {int(o[5:]) for _, o in opts.choices if o.startswith("full:")}
                if fit and fit[0] > 1 and fit[0] - 1 not in priced:
                    return False
        return True

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
            self.moves.append({(0, 0): _Options(list(rows), patterns, None)})
        return True


def _price(workload, base: PlanArrays, cands: _Candidates, c: Coefficients):
    """Each candidate rank priced by `evaluate` (ranks=True): its micro-batch time, tail and peak memory."""
    outer_idx, ranks, counts, full, sel = cands.arrays()
    pa = PlanArrays({name: col[outer_idx] for name, col in base.columns.items() if name != "split"}
                    | {"split": np.arange(len(ranks))}, RankTable(ranks, counts, full, sel))
    res = evaluate(workload, pa, c, ranks=True)
    return res["rank_per_mb"][:, 0], res["rank_tail"][:, 0], res["rank_memory"][:, 0]


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
        for (a, end), opts in moves.items():
            if id(opts) not in reduced:
                rows = np.array(opts.rows)
                ok = np.flatnonzero(fits[rows])
                front = _front(np.zeros(len(ok)), per_mb[rows[ok]], tail[rows[ok]], np.zeros(len(ok)))
                reduced[id(opts)] = [(int(rows[ok[j]]), opts.choices[ok[j]]) for j in front]
            for row, pick in reduced[id(opts)]:
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
    base = PlanArrays.from_plans([p.plan if p else outer_of(plans[0]) for p in problems], profile)
    budget = workload.memory_budget
    priced = [_price(workload, base, cands, c)]
    for everything in (False, True):  # the least K that fits, for the ranges of one kind (`_Problem.refine`)
        memory = np.concatenate([p[2] for p in priced])
        more = _Candidates(n_kinds, start=len(memory))
        for i, problem in enumerate(problems):
            if problem is not None and problem.v == 1 and (not everything or not problem.confirmed(memory, budget)):
                problem.refine(more, i, memory, budget, everything)
        if more.rank:
            priced.append(_price(workload, base, more, c))
    per_mb, tail, memory = (np.concatenate([p[j] for p in priced]) for j in range(3))
    fits = memory <= budget
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


def lower_bound(pa: PlanArrays, res: dict) -> np.ndarray:
    """(N,) a lower bound of the solver's optimum for each outer plan of `pa`, from `evaluate(workload,
    pa, ranks=True)` of the plans without recompute (their split does not matter): memory ignored, no
    recompute (which only adds time), and the blocks shared perfectly. Why it holds: a rank's GPU and host
    times per micro-batch are linear in its blocks, so their sums over the ranks, G and H, are the same for
    every split; its micro-batch takes the host_overlap-norm of the two, and a norm is subadditive, so the
    ranks' sum is at least norm(G, H) (G + H ... max(G, H): at least max(G, H) whatever the norm) and the
    slowest rank at least a pp-th of that; the pipe of `model._schedule` grows with both (1F1B, GPipe:
    sum + (m - 1) slowest; interleaved: sum / v + (m - 1/v) slowest); the data-parallel tail is at least 0.
    Plans the solver does not solve get +inf."""
    g, h, mult = res["rank_gpu_mb"], res["rank_host_mb"], res["rank_mult"]
    total = np.maximum((g * mult).sum(axis=1), (h * mult).sum(axis=1))
    pp, m, v = (np.asarray(pa.columns[n], dtype=float) for n in ("pp", "num_micro_batches", "virtual_stages"))
    slowest = total / pp
    pipe = np.where(v > 1, total / v + (m - 1 / v) * slowest, total + (m - 1) * slowest)
    solved = np.isin(np.asarray(pa.schedule), [SCHEDULES.index(s) for s in SOLVED_SCHEDULES])
    return np.where(solved, pipe + res["rank_const"], np.inf)


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
