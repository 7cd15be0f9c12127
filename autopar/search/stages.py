"""The exact per-stage solver (issue 41): for a uniform outer plan, the layer split (with stages of no
block at the ends) and the per-stage recompute that minimise the cost model's iteration time with
every pipeline rank within the memory budget.

It follows the structure of the cost model's objective (autopar/cost/model.py): each pipeline rank's
time per micro-batch, its data-parallel tail (exposed gradient collectives and optimizer step) and its
peak memory depend only on the rank's position and its blocks (by kind, and how each is recomputed), and

    iteration = S - sigma + m x M + the largest tail + constants

with M the slowest rank's micro-batch time, S the sum of the ranks' shares (`zero_bubble.rank_share`:
1F1B and GPipe a rank's micro-batch, interleaved a v-th of it, the zero-bubble schedules what their W
passes leave idle) and sigma the slowest rank's share. A dynamic programme over the ranks in pipeline
order keeps, for each number of blocks placed so far, the partial plans whose ranks fit that no other
dominates (`_front`): a partial plan dominated completes no better than the one that dominates it, for
every completion. Under 1F1B, GPipe and interleaved (sigma = M / v) that is the Pareto front of
(S, S - sigma + m M, largest tail); under the zero-bubble schedules, whose share is not a function of
the micro-batch time (a faster rank can leave the slowest rank's place to one with a smaller share),
dominance across different M also needs the bounds of share / micro-batch over the candidates. Every
rank candidate (position, blocks, their recompute) is priced once, all in one `evaluate(...,
ranks=True)` call over a `RankTable`: the same functions that price whole plans, no second cost model.

With one stage per rank (1F1B, GPipe, zb on one chunk) the split and the recompute are both searched,
and the first and the last stage may hold no block (embedding-only, head-only). With several chunks per
rank (interleaved, zb on v chunks, and zbv / dualpipev's V of two) a rank's figures depend on all its
chunks together, which the DP over stages cannot carry: there the split stays balanced and every rank's
pattern of per-chunk recompute is searched exactly (up to MAX_PATTERNS patterns per rank; beyond, the
plan is not solved: None).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.cost import Coefficients, PlanArrays, evaluate, zero_bubble
from autopar.cost.model import LAYER_FLOORS, micro_batches_kept
from autopar.cost.arrays import RankTable, unique_rows
from autopar.knobs import SCHEDULES, V_SCHEDULES, balanced_split, knob, rank_stages, stage_full_blocks, stage_rank
from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.search.space import choices, plan_of, values_of

MAX_PATTERNS = 4096  # per-chunk recompute patterns of one rank under the interleaved schedule
PACK = 64  # points of a dominance front compared in one block (`_Dominance.front`)
DETAILS = ("zero", "offload_optimizer", "grad_comm_dtype", "dp_replicate")  # `detail_variants`' knobs


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


def detail_variants(workload, plan: Plan) -> list[Plan]:
    """The outer plan with one of DETAILS at each other value the space offers it: memory a per-stage split
    frees can drop an offload, a ZeRO stage or HSDP's replicas that every uniform plan of the layout needed,
    so a search that met only those plans finishes these too."""
    decided = values_of(outer_of(plan))
    out: list[Plan] = []
    for name in DETAILS:
        for value in choices(workload, knob(name), decided):
            try:
                variant = plan_of(workload, {**decided, name: value})
                variant.validate(workload)
            except PlanError:
                continue
            if variant != outer_of(plan) and variant not in out:
                out.append(variant)
    return out


def mesh_variants(workload, plan: Plan) -> list[Plan]:
    """The plan, its split and per-stage recompute kept, in each other mesh order the space offers it: the
    order decides which links the groups' collectives cross, not what a rank holds, so a finished plan is
    priced again in each rather than solved again."""
    return [plan.with_(mesh_order=order) for order in choices(workload, knob("mesh_order"), values_of(plan))
            if order != plan.mesh_order]


def worth_solving(plan: Plan, profile) -> bool:
    """Whether the solver can find a plan no uniform plan is: not for one stage of a model of one block kind,
    whose one recompute setting is a uniform plan's (the uniform search has those)."""
    return plan.pp > 1 or len(profile.layers) > 1


class _Candidates:
    """Rank candidates of a batch of outer plans, gathered in bulk for one evaluate call."""

    def __init__(self, n_kinds: int, start: int = 0):
        self.n_kinds, self.start, self.size = n_kinds, start, 0
        self.outer, self.rank, self.counts, self.full, self.sel = [], [], [], [], []

    def add(self, outer: int, rank: int, counts: np.ndarray, full: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Rows for `len(full)` candidates of one rank with the same blocks (`counts`); their indices."""
        n = len(full)
        start = self.add_rows(outer, np.full(n, rank), np.broadcast_to(counts, (n, self.n_kinds)), full, sel)
        return np.arange(start, start + n)

    def add_rows(self, outer: int, rank: np.ndarray, counts: np.ndarray, full: np.ndarray, sel: np.ndarray) -> int:
        """Rows for candidates of several ranks at once (`rank`, `counts` per row); the index of the first."""
        start, n = self.start + self.size, len(rank)
        self.size += n
        self.outer.append(np.full(n, outer))
        self.rank.append(rank)
        self.counts.append(counts)
        self.full.append(full)
        self.sel.append(sel)
        return start

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
        self.options: list[list[_Options]] = []  # per rank: its distinct _Options
        self.spans: list[tuple] = []  # per rank: (from, to, index into its options) arrays, one per range it may hold

    def ends(self, rank: int) -> np.ndarray:
        """The embedding on the rank of the first stage, the head on the rank of the last (V: both on rank 0)."""
        e = np.zeros(self.cum.shape[1])
        e[0] += rank == stage_rank(0, self.pp, self.plan.schedule)
        e[-1] += rank == stage_rank(self.pp * self.v - 1, self.pp, self.plan.schedule)
        return e

    def build(self, cands: _Candidates, index: int, skeletons: dict) -> bool:
        """Its candidate rows in `cands`; `skeletons`: what outer plans of one model share, kept by the caller
        across `solve` calls: the ranges of each pp (`_skeleton`) and their rows (`_rows`) under one stage per
        rank, each rank's chunk patterns (`_patterns`) under several."""
        return (self._build_looped if self.v == 1 else self._build_interleaved)(cands, index, skeletons)

    def _range(self, a: int, n: int, options: list[str]):
        """Blocks [a, a + n) and, per option, those fully and selectively recomputed (by kind)."""
        m = len(options)
        held, full, sel = self._blocks(np.full(m, a), np.full(m, n), *_menu(options))
        return held[0], full, sel

    def _blocks(self, a: np.ndarray, n: np.ndarray, k: np.ndarray, sel: np.ndarray):
        """Per row (first block, blocks, K of full:K, selective or not), by kind: the blocks held, fully
        recomputed (the first K) and selectively recomputed."""
        held = self.cum[a + n] - self.cum[a]
        return held, self.cum[a + k] - self.cum[a], held * sel[:, None]

    def _build_looped(self, cands: _Candidates, index: int, skeletons: dict) -> bool:
        if self.pp not in skeletons:
            skeletons[self.pp] = self._skeleton()
        spans, keys = skeletons[self.pp]
        table = ("rows", self.pp, self.plan.schedule, self.selective)
        if table not in skeletons:  # every key's rows, the same in every outer plan of this pp and schedule
            skeletons[table] = self._rows(keys)
        (rank, counts, full, sel), offsets, entries, one_kind = skeletons[table]
        start = cands.add_rows(index, rank, counts, full, sel)
        options_of = {key: _Options(list(range(start + a, start + b)), list(entries[key]), one_kind[key])
                      for key, (a, b) in offsets.items()}
        self.options = [[options_of[key] for key in rank_keys] for rank_keys, _ in spans]
        self.spans = [rank_spans for _, rank_spans in spans]
        return True

    def _rows(self, keys: dict) -> tuple:
        """The candidate rows of every key (`_skeleton`): each of its blocks' recompute options (a range of one
        kind priced at full:1 and full:n only, the least K that fits found from them: `refine`), as arrays
        (rank, blocks by kind with the ends, fully and selectively recomputed), with each key's (from, to)
        offsets into them, its (blocks, recompute) entries and, for a range of one kind, what `refine` needs."""
        cum, kinds = self.cum, self.kinds
        run_end = np.arange(1, len(kinds) + 1)  # per block, the end of the run of its kind that it starts
        for b in range(len(kinds) - 2, -1, -1):
            if kinds[b] == kinds[b + 1]:
                run_end[b] = run_end[b + 1]
        menus: dict = {}  # (n, one kind) -> its options, their full-recompute counts and selective flags
        columns: tuple[list, ...] = ([], [], [], [], [])  # per row: rank, first block, blocks, K, selective
        offsets, entries, one_kind, size = {}, {}, {}, 0
        for key, (r, a, n) in keys.items():
            single = n > 3 and a + n <= run_end[a]
            if (n, single) not in menus:
                options = stage_options(n, self.selective)
                if single:
                    options = [o for o in options if not o.startswith("full:")] + ["full:1", f"full:{n}"]
                menus[n, single] = (options, *(part.tolist() for part in _menu(options)))
            options, ks, sels = menus[n, single]
            for column, values in zip(columns, ([r] * len(options), [a] * len(options), [n] * len(options), ks, sels)):
                column.extend(values)
            offsets[key] = (size, size + len(options))
            size += len(options)
            entries[key] = [(n, o) for o in options]
            one_kind[key] = (r, a, n, cum[a + n] - cum[a]) if single else None
        rank, a, n, k, sel = (np.array(c, dtype=np.int64) for c in columns)
        held, full, selective = self._blocks(a, n, k, sel)
        ends = np.array([self.ends(r) for r in range(self.pp)])
        return (rank, held + ends[rank], full, selective), offsets, entries, one_kind

    def _skeleton(self) -> tuple[list[tuple], dict]:
        """Per rank, its keys and the (from, to, key index) arrays of each range of blocks it may hold, and each
        key's (rank, first block, blocks): a key per rank and sequence of block kinds, since ranks alike price
        alike. The same for every outer plan of this pp (one stage per rank: the ends on the first and the
        last rank)."""
        ident = _sequence_ids(self.kinds)
        spans, keys = [], {}
        for r in range(self.pp):
            src, dst = self._ranges(r)
            cid = ident[src, dst]
            uniq, first, inverse = np.unique(cid, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")  # keys in the order their first range comes
            position = np.empty_like(order)
            position[order] = np.arange(len(order))
            rank_keys = [(r, int(uniq[o])) for o in order]
            for key, o in zip(rank_keys, order):
                keys.setdefault(key, (r, int(src[first[o]]), int(dst[first[o]] - src[first[o]])))
            spans.append((rank_keys, (src, dst, position[inverse.reshape(-1)])))
        return spans, keys

    def _ranges(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(first block, end) arrays of the ranges rank r may hold, first block then end ascending: every rank
        before and after it can still hold its share (a block each; the first and the last none, with a
        pipeline)."""
        pp, L = self.pp, self.layers
        if pp == 1:
            return np.array([0]), np.array([L])
        lo_a, hi_a = (0, 0) if r == 0 else (r - 1, L)
        lo_n = 0 if r in (0, pp - 1) else 1
        a, end = np.meshgrid(np.arange(lo_a, hi_a + 1), np.arange(L + 1), indexing="ij")
        ok = (end - a >= lo_n) & ((end == L) if r == pp - 1 else (end <= L - max(pp - r - 2, 0)))
        return a[ok], end[ok]

    def refine(self, cands: _Candidates, index: int, memory: np.ndarray, budget: float, everything: bool) -> None:
        """A second look at the ranks of one block kind priced at full:1 and full:n only. Their memory falls
        and their time grows with K (a recomputed block keeps its output instead of its activations; its
        forward runs again), so only the least K that fits can be in an optimum: estimated between the two
        (memory is affine in K), then priced with K - 1 to confirm (`everything`: every K, when it did not)."""
        for rank_options in self.options:
            for opts in rank_options:
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
        for rank_options in self.options:
            for opts in rank_options:
                if opts.one_kind is None:
                    continue
                fit = sorted(int(o[5:]) for row, (_, o) in zip(opts.rows, opts.choices)
                             if o.startswith("full:") and memory[row] <= budget)
                priced = {int(o[5:]) for _, o in opts.choices if o.startswith("full:")}
                if fit and fit[0] > 1 and fit[0] - 1 not in priced:
                    return False
        return True

    def _build_interleaved(self, cands: _Candidates, index: int, skeletons: dict) -> bool:
        table = ("chunks", self.pp, self.v, self.plan.schedule, self.selective)
        if table not in skeletons:  # the same in every outer plan of this pp, v and schedule
            skeletons[table] = self._patterns()
        per_rank = skeletons[table]
        if per_rank is None:
            return False
        for rows, patterns in per_rank:
            start = cands.add_rows(index, *rows)
            self.options.append([_Options(list(range(start, start + len(patterns))), patterns, None)])
            self.spans.append((np.zeros(1, dtype=np.int64),) * 3)  # blocks placed stay 0: the split is fixed
        return True

    def _patterns(self) -> list | None:
        """Per rank of the balanced split over pp x v stages, a row per pattern of its chunks' recompute options
        (rank, its blocks with the ends, those fully and selectively recomputed) and the patterns; None past
        MAX_PATTERNS."""
        pp, v = self.pp, self.v
        split = balanced_split(self.layers, pp * v)
        starts = np.concatenate([[0], np.cumsum(split)])
        out = []
        for r in range(pp):
            stages = rank_stages(pp, v, self.plan.schedule, r)
            per_stage = [stage_options(split[s], self.selective) for s in stages]
            if np.prod([len(o) for o in per_stage], dtype=float) > MAX_PATTERNS:
                return None
            held = sum(self.cum[starts[s + 1]] - self.cum[starts[s]] for s in stages)
            ranges = [self._range(int(starts[s]), split[s], o) for s, o in zip(stages, per_stage)]
            combos = np.array(list(itertools.product(*[range(len(o)) for o in per_stage])), dtype=np.int64)
            full = sum(ranges[i][1][combos[:, i]] for i in range(len(stages)))
            sel = sum(ranges[i][2][combos[:, i]] for i in range(len(stages)))
            n = len(combos)
            out.append(((np.full(n, r), np.broadcast_to(held + self.ends(r), (n, len(held))), full, sel),
                        list(itertools.product(*per_stage))))
        return out


def _menu(options: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per recompute option of a stage, the K of its full:K (0 for none and selective) and whether selective."""
    return (np.array([stage_full_blocks(o) for o in options], dtype=np.int64),
            np.array([o == "selective" for o in options], dtype=np.int64))


def _selective(workload, outer: Plan) -> bool:
    """Whether a stage may recompute selectively: the model has an attention core to drop at this pp, and
    the schedule runs it (the zero-bubble schedules do not: the schedule knob's rule says why)."""
    if not any(mode == "selective" for mode, _ in knob("recompute").choices(workload, {"pp": outer.pp})):
        return False
    try:
        knob("schedule").check(outer.with_(recompute="selective"))
    except PlanError:
        return False
    return True


def _price(workload, base: PlanArrays, cands: _Candidates, c: Coefficients):
    """Each candidate rank priced by `evaluate` (ranks=True): its micro-batch time, share, tail and peak memory.
    A row is its outer plan, rank and blocks held, fully and selectively recomputed, by kind: chunk patterns
    with the same sums (full:1 on one chunk or on another) are one row, priced once (GPT-3 175B, the rl
    planner's 8 interleaved outer plans: 81,724 candidates, 1,884 rows)."""
    outer_idx, ranks, counts, full, sel = cands.arrays()
    blocks = np.hstack([counts, full, sel])
    whole = blocks.astype(np.int64)  # counts of blocks: integer keys sort once (`unique_rows`), floats per column
    first, inverse = unique_rows([outer_idx, ranks, *(whole if (whole == blocks).all() else blocks).T])
    pa = PlanArrays({name: col[outer_idx[first]] for name, col in base.columns.items() if name != "split"}
                    | {"split": np.arange(len(first))}, RankTable(ranks[first], counts[first], full[first], sel[first]))
    res = evaluate(workload, pa, c, ranks=True)
    return (*(res[f"rank_{name}"][:, 0][inverse] for name in ("per_mb", "share", "tail", "memory")),
            np.asarray(res["rank_const"])[inverse])


@dataclass(frozen=True)
class _Dominance:
    """How partial plans of one outer plan compare (module doc): m micro-batches, and the least and the
    largest share / micro-batch time of its candidate ranks (any later rank is one of them)."""

    m: float
    low: float
    high: float

    def front(self, b, S, M, sig, T) -> np.ndarray:
        """Indices of the points no other point with the same b dominates (ties: the first kept). A dominates
        B when A completes no worse whatever the later ranks: with c = S - sigma + m M (the objective if no
        later rank is slower), S_A <= S_B (a later rank slower than both), c_A <= c_B (none slower), T_A <= T_B,
        and where their slowest differ, for a later slowest x between them (its share within [low, high] x):
        M_A < M_B needs S_A + (m - low) M_B <= c_B, M_A > M_B needs c_A <= S_B + (m - high) M_B.
        In the order (b, S, c, T) a point is dropped when any point before it dominates it."""
        c = S - sig + self.m * M
        order = np.lexsort((T, c, S, b))
        pts = (b[order], S[order], M[order], c[order], T[order])
        starts = np.concatenate([[0], np.flatnonzero(np.diff(pts[0])) + 1]).astype(np.int64)
        ends = np.append(starts[1:], len(order))
        if not len(order):  # no point: no group
            starts = ends = np.zeros(0, dtype=np.int64)
        keep = np.ones(len(order), dtype=bool)
        big = ends - starts > 2 * PACK
        for lo, hi in zip(starts[big], ends[big]):
            keep[lo:hi] = self._large_group(pts, lo, hi)
        # the other groups compared in blocks of about PACK points (a pair from two groups never counts):
        # fewer, larger numpy calls than one per group
        blocks, block, size = [], [], 0
        for lo, hi in zip(starts[~big].tolist(), ends[~big].tolist()):
            block.append(np.arange(lo, hi))
            size += hi - lo
            if size >= PACK:
                blocks.append(np.concatenate(block))
                block, size = [], 0
        if block:
            blocks.append(np.concatenate(block))
        for idx in blocks:
            if len(idx) > 1:
                keep[idx] = ~np.triu(self._dominates(pts, idx, idx), k=1).any(axis=0)
        return order[keep]

    def _dominates(self, pts, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(rows), len(cols)): whether each point of `rows` dominates each of `cols` (positions in the sorted
        points `pts`; a row must come before its column in that order, which gives S_row <= S_col)."""
        b, S, M, c, T = pts
        ok = (b[rows][:, None] == b[cols][None, :]) & (c[rows][:, None] <= c[cols][None, :]) \
            & (T[rows][:, None] <= T[cols][None, :])
        Mr, Mc = M[rows][:, None], M[cols][None, :]
        ok &= ~(Mr < Mc) | (S[rows][:, None] + (self.m - self.low) * Mc <= c[cols][None, :] * (1 + 1e-12))
        ok &= ~(Mr > Mc) | (c[rows][:, None] <= S[cols][None, :] + (self.m - self.high) * Mc)
        return ok

    def _large_group(self, pts, lo: int, hi: int) -> np.ndarray:
        """The kept mask of the sorted positions [lo, hi) of one b, as the all-pairs comparison gives it, without
        comparing all pairs: a first pass drops, chunk by chunk, what an earlier kept point or an earlier point of
        its chunk dominates (both are earlier points: dropping is right); what survives is then compared with
        every earlier point of the group, so a point stays exactly when no earlier point dominates it. Fronts are
        small against their groups (one point of thousands under the interleaved schedule's patterns)."""
        kept = np.zeros(0, dtype=np.int64)
        for a in range(lo, hi, PACK):
            chunk = np.arange(a, min(a + PACK, hi))
            out = np.triu(self._dominates(pts, chunk, chunk), k=1).any(axis=0)
            if len(kept):
                out |= self._dominates(pts, kept, chunk).any(axis=0)
            kept = np.concatenate([kept, chunk[~out]])
        mask = np.zeros(hi - lo, dtype=bool)
        for a in range(0, len(kept), PACK):
            cols = kept[a:a + PACK]
            rows = np.arange(lo, int(cols.max()))
            beaten = self._dominates(pts, rows, cols) & (rows[:, None] < cols[None, :])
            mask[cols[~beaten.any(axis=0)] - lo] = True
        return mask


def _sequence_ids(kinds: np.ndarray) -> np.ndarray:
    """(L + 1, L + 1): ids[a, end] names the sequence of block kinds kinds[a:end] (0 the empty one), equal
    ids for equal sequences: a sequence is its one-shorter prefix and its last kind, numbered level by level."""
    L = len(kinds)
    ids = np.full((L + 1, L + 1), -1, dtype=np.int64)
    ids[np.arange(L + 1), np.arange(L + 1)] = 0
    prev, top = np.zeros(L + 1, dtype=np.int64), 1
    for n in range(1, L + 1):
        a = np.arange(L - n + 1)
        pair = prev[a] * (int(kinds.max(initial=0)) + 1) + kinds[a + n - 1]
        _, code = np.unique(pair, return_inverse=True)
        prev = code.reshape(-1) + top
        top = int(prev.max()) + 1
        ids[a, a + n] = prev
    return ids


def _rank_rows(problem: _Problem, r: int) -> np.ndarray:
    """The candidate rows of rank r, all its options'."""
    return np.array([row for opts in problem.options[r] for row in opts.rows], dtype=np.int64)


def _dominance(problem: _Problem, per_mb, share) -> tuple[list[_Dominance | None], _Dominance]:
    """Per rank, how its partial plans compare: the bounds of share / micro-batch over the candidates of the
    ranks after it (only those can be a later slowest rank); None for the last (no later rank: the
    objective itself, c, and the tail decide). And the bounds over every rank's candidates (`whole`)."""
    m = float(problem.plan.num_micro_batches)
    ratios = []
    for r in range(problem.pp):
        rows = _rank_rows(problem, r)
        rows = rows[per_mb[rows] > 0]
        ratio = share[rows] / per_mb[rows]
        ratios.append((ratio.min(), ratio.max()) if len(ratio) else (np.inf, -np.inf))
    out: list[_Dominance | None] = [None]
    low, high = np.inf, -np.inf
    for lo, hi in reversed(ratios[1:]):
        low, high = min(low, lo), max(high, hi)
        out.append(_Dominance(m, float(low), float(high)))
    whole = _Dominance(m, float(min(lo for lo, _ in ratios)), float(max(hi for _, hi in ratios)))
    return out[::-1], whole


def _reduce(options: list, reduced: dict, dom: _Dominance, per_mb, share, tail, fits) -> None:
    """Each option set's rows that fit and that no other row of the set dominates (a rank alone is a partial
    plan: the dominance applies as it is), in one `front` call: reduced[id(set)] = [(row, choice)]."""
    if not options:
        return
    rows = [np.asarray(o.rows) for o in options]
    which = np.concatenate([np.full(len(r), i) for i, r in enumerate(rows)])
    index = np.concatenate([np.arange(len(r)) for r in rows])
    rows = np.concatenate(rows)
    ok = np.flatnonzero(fits[rows])
    r = rows[ok]
    kept = ok[dom.front(which[ok], share[r], per_mb[r], share[r], tail[r])]
    for o in options:
        reduced[id(o)] = []
    for k in np.sort(kept):
        o = options[which[k]]
        reduced[id(o)].append((int(rows[k]), o.choices[index[k]]))


def _floors(problem: _Problem, per_mb, share, tail, fits) -> np.ndarray:
    """(pp + 1, 3): per rank r, what the ranks from r on add at least (each takes one of its candidates
    that fit): the sum of their least shares, the largest of their least micro-batch times and of their
    least tails."""
    out = np.zeros((problem.pp + 1, 3))
    for r in range(problem.pp - 1, -1, -1):
        rows = _rank_rows(problem, r)
        rows = rows[fits[rows]]
        least = (share[rows].min(), per_mb[rows].min(), tail[rows].min()) if len(rows) else (np.inf,) * 3
        out[r] = (out[r + 1, 0] + least[0], max(out[r + 1, 1], least[1]), max(out[r + 1, 2], least[2]))
    return out


def _solve_one(problem: _Problem, per_mb, share, tail, fits, target: float = np.inf, const: float = 0.0):
    """The DP over ranks: (blocks placed, S, M, sigma, largest tail, parent, choice) per rank, pruned to
    the points no other dominates (`_Dominance.front`) and, given a `target` iteration time, to those
    whose completion can still beat it: iteration >= S + (m - high) M + the largest tail + const, with
    sigma <= high M (high: the largest share / micro-batch of any candidate) and every later rank at least
    its least share, micro-batch time and tail (`_floors`)."""
    doms, whole = _dominance(problem, per_mb, share)
    floors = _floors(problem, per_mb, share, tail, fits) if np.isfinite(target) else None
    if floors is not None:  # a rank with nothing that fits, or the whole plan's bound already no better
        first = floors[0]
        if not np.isfinite(first).all() or (first[0] + (whole.m - whole.high) * first[1] + first[2] + const
                                            >= target * (1 + 1e-9)):
            return None
    b, S, M, sig, T = (np.zeros(1) for _ in range(5))
    layers = []
    reduced: dict = {}  # the options of a rank's blocks that fit and that no other option dominates (`_reduce`)
    for r, ((src, dst, kid), dom) in enumerate(zip(problem.spans, doms)):
        _reduce([o for o in problem.options[r] if id(o) not in reduced], reduced, whole, per_mb, share, tail, fits)
        # every range with each of its options' reduced rows: the moves, flattened
        kept = [reduced[id(o)] for o in problem.options[r]]
        counts = np.array([len(k) for k in kept])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rows = np.array([row for k in kept for row, _ in k], dtype=np.int64)
        picks = [pick for k in kept for _, pick in k]
        each = counts[kid]
        if not each.sum():
            return None
        first = np.repeat(starts[kid] - np.concatenate([[0], np.cumsum(each)[:-1]]), each)
        flat = first + np.arange(int(each.sum()))  # index into rows / picks of each move
        src_b, dst_b = np.repeat(src, each), np.repeat(dst, each)
        p, sh, tl = per_mb[rows[flat]], share[rows[flat]], tail[rows[flat]]
        # join every point with every move from its block count
        pair_pt, pair_mv = np.nonzero(b[:, None] == src_b[None, :])
        if len(pair_pt) == 0:
            return None
        slower = p[pair_mv] > M[pair_pt]  # the new rank is the slowest (ties: the earlier rank stays)
        nb, nS = dst_b[pair_mv], S[pair_pt] + sh[pair_mv]
        nM = np.where(slower, p[pair_mv], M[pair_pt])
        nsig = np.where(slower, sh[pair_mv], sig[pair_pt])
        nT = np.maximum(T[pair_pt], tl[pair_mv])
        if floors is not None:  # branch and bound: drop what cannot beat the target
            rest = floors[r + 1]
            least = (nS + rest[0] + (whole.m - whole.high) * np.maximum(nM, rest[1]) + np.maximum(nT, rest[2])
                     + const)
            alive = np.flatnonzero(least < target * (1 + 1e-9))
            if len(alive) == 0:
                return None
            pair_pt, pair_mv = pair_pt[alive], pair_mv[alive]
            nb, nS, nM, nsig, nT = nb[alive], nS[alive], nM[alive], nsig[alive], nT[alive]
        if dom is None:  # the last rank: the objective and the tail alone
            c = nS - nsig + whole.m * nM
            keep = whole.front(nb, c, np.zeros_like(c), np.zeros_like(c), nT)
        else:
            keep = dom.front(nb, nS, nM, nsig, nT)
        layers.append((pair_pt[keep], [picks[i] for i in flat[pair_mv[keep]]]))
        b, S, M, sig, T = nb[keep], nS[keep], nM[keep], nsig[keep], nT[keep]
    done = np.flatnonzero(b == (problem.layers if problem.v == 1 else 0))
    return (done, layers) if len(done) else None


def _trace(layers, point: int) -> list:
    """The choice of each rank on the path to `point` of the last front."""
    path = []
    for parents, picks in reversed(layers):
        path.append(picks[point])
        point = int(parents[point])
    return path[::-1]


def solve(workload, plans: list[Plan], coeffs: Coefficients | None = None,
          target: float = np.inf, skeletons: dict | None = None) -> list[Solved | None]:
    """Per outer plan (its recompute and split are ignored), the best per-stage plan in memory, or None
    (nothing fits, more per-chunk patterns than MAX_PATTERNS, or, given a `target` iteration time, no plan
    beats it: the search only needs those). `skeletons`: a dict the caller keeps across calls for one
    workload, where the candidate ranges and rows each pp shares are kept (`_Problem.build`)."""
    c = coeffs if coeffs is not None else Coefficients.for_cluster(workload.cluster, workload.runtime)
    profile = workload.profile
    kinds = np.array([k for k, e in enumerate(profile.layers, start=1) for _ in range(e.count)], dtype=np.int64)
    n_kinds = len(profile.blocks)
    cum = np.vstack([np.zeros(n_kinds), np.cumsum(np.eye(n_kinds)[kinds], axis=0)])
    selective = {}
    problems: list[_Problem | None] = []
    cands = _Candidates(n_kinds)
    skeletons = {} if skeletons is None else skeletons
    for i, plan in enumerate(plans):
        outer = outer_of(plan)
        key = (outer.pp, outer.schedule)
        if key not in selective:
            selective[key] = _selective(workload, outer)
        problem = _Problem(workload, outer, selective[key], cum, kinds)
        problems.append(problem if problem.build(cands, i, skeletons) else None)
    out: list[Solved | None] = [None] * len(plans)
    if not cands.rank:
        return out
    base = PlanArrays.from_plans([p.plan if p else outer_of(plans[0]) for p in problems], profile)
    budget = workload.memory_budget
    priced = [_price(workload, base, cands, c)]
    for everything in (False, True):  # the least K that fits, for the ranges of one kind (`_Problem.refine`)
        memory = np.concatenate([p[3] for p in priced])
        more = _Candidates(n_kinds, start=len(memory))
        for i, problem in enumerate(problems):
            if problem is not None and problem.v == 1 and (not everything or not problem.confirmed(memory, budget)):
                problem.refine(more, i, memory, budget, everything)
        if more.rank:
            priced.append(_price(workload, base, more, c))
    per_mb, share, tail, memory, const = (np.concatenate([p[j] for p in priced]) for j in range(5))
    fits = memory <= budget
    # the last front of each plan: its points, whole plans, priced by evaluate itself (pipe's formula
    # is the schedule's own); the least is the optimum
    finals, owner = [], []
    for i, problem in enumerate(problems):
        row = problem.options[0][0].rows[0] if problem is not None else None
        found = None if problem is None else _solve_one(problem, per_mb, share, tail, fits, target, const[row])
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
            if times[best] < target:
                out[i] = Solved(finals[best], float(times[best]), bool(res["fits"][best]))
    return out


HUGE = 1e30  # seconds past every rank's pieces (`recompute_floors`)
BOUND_INPUTS = ("rank_gpu_mb", "rank_host_mb", "rank_mult", "rank_weight", "rank_dp_floor", "rank_optimizer",
                "rank_const", "rank_least_memory", "workspace", "kind_states",
                *LAYER_FLOORS)  # what `lower_bound` reads of `evaluate(..., ranks=True)`


def lower_bound(pa: PlanArrays, res: dict, budget: float = np.inf, rows: np.ndarray | None = None,
                below: float = np.inf) -> np.ndarray:
    """(N,) a lower bound of the solver's optimum for each outer plan of `pa` (or of its `rows`; the
    recompute floors only where the bound without them is below `below`: a cheaper bound elsewhere), from
    `evaluate(workload, pa, ranks=True)` of the plans without recompute (their split does not matter); inf
    where no split and recompute can fit the per-GPU `budget`. Why it holds: a rank's GPU and host times per
    micro-batch, its optimizer step, its model states and the affine floor of its exposed data-parallel
    collectives (`rank_dp_floor`) are linear in its blocks, so their sums over the ranks are the same for every
    split and recompute (G, H, O, D, the states). Time: a rank's micro-batch takes the host_overlap-norm of its
    two times, and a norm is subadditive, so the ranks' sum is at least total = max(G + R, H), R the recompute
    the budget forces (`recompute_floors`), and the slowest rank M at least a pp-th of it and at least the
    floor `recompute_floors` gives. The pipe is S - sigma + m M (module doc) with every share at least 0 and at
    least (per_mb - kappa W) / nu (`zero_bubble.share_floor`; W, the weight-gradient passes, summed over the
    ranks is the same for every split and recompute): so at least m M and at least (total - kappa W) / nu +
    (m - 1 / nu) M (1F1B, GPipe: sum + (m - 1) slowest; interleaved: sum / v + (m - 1/v) slowest), both
    increasing in M and total; the data-parallel tail is the largest rank's exposed collectives and step, at
    least their mean, (max(D, 0) + O) / pp. Memory: every rank within the budget needs the ranks' least memory
    (`rank_least_memory`: states, workspace, each block's least activation once) summed within pp budgets."""
    if rows is not None:
        pa, res = _bound_rows(pa, res, rows)
    mult = res["rank_mult"]
    pp, m, v = (np.asarray(pa.columns[n], dtype=float) for n in ("pp", "num_micro_batches", "virtual_stages"))
    gpu, host = (res["rank_gpu_mb"] * mult).sum(axis=1), (res["rank_host_mb"] * mult).sum(axis=1)
    weight = (res["rank_weight"] * mult).sum(axis=1)
    kappa, nu = zero_bubble.share_floor(np.asarray(pa.schedule), v)
    dp_floor = np.maximum((res["rank_dp_floor"] * mult).sum(axis=1), 0.0)
    tail = (dp_floor + (res["rank_optimizer"] * mult).sum(axis=1)) / pp
    fits = (res["rank_least_memory"] * mult).sum(axis=1) <= pp * budget

    def bound(i, forced=0.0, least_slowest=0.0):
        total = np.maximum(gpu[i] + forced, host[i])
        slowest = np.maximum(total / pp[i], least_slowest)
        pipe = np.maximum(m[i] * slowest, (total - kappa[i] * weight[i]) / nu[i] + (m[i] - 1 / nu[i]) * slowest)
        return pipe + tail[i] + res["rank_const"][i]

    out = np.where(fits, bound(slice(None)), np.inf)
    sharpen = np.flatnonzero(out < below)
    if len(sharpen):
        forced, least_slowest = recompute_floors(*_bound_rows(pa, res, sharpen), budget)
        feasible = np.isfinite(forced)
        out[sharpen] = np.where(feasible, bound(sharpen, np.where(feasible, forced, 0.0),
                                                np.where(feasible, least_slowest, 0.0)), np.inf)
    return out


def _bound_rows(pa: PlanArrays, res: dict, rows: np.ndarray) -> tuple[PlanArrays, dict]:
    """The plans `rows` of `pa` with what `lower_bound` reads of their results."""
    return pa.take(rows), {k: res[k][rows] for k in BOUND_INPUTS}


KIND_FLOORS = {"s": "kind_states", "a": "kind_activations", "c": "kind_least_activations", "t": "kind_seconds",
               "e1": "kind_rate", "e2": "kind_rate2", "k": "kind_intercept", "ef": "kind_full_rate",
               "h": "kind_held"}  # `_allocation_floors`' names


def recompute_floors(pa: PlanArrays, res: dict, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """(N,) x 2: the least recompute, in seconds per micro-batch summed over the ranks, that any split must
    spend for every rank to fit `budget`, and the least micro-batch time its slowest rank can have (both inf
    where no split fits). Each is the larger of two floors (`_allocation_floors`): every layer at the least
    of each figure over the layers' kinds, and the one kind whose layers hold the most, the others left out
    (fewer layers only lower both)."""
    n = len(pa)
    if not np.isfinite(budget) or n == 0:
        return np.zeros(n), np.zeros(n)
    layers = res["kind_layers"]
    is_layer = layers > 0
    lowest = {name: np.where(is_layer, res[key], np.inf).min(axis=1) for name, key in KIND_FLOORS.items()}
    forced, slowest = _allocation_floors(pa, res, budget, lowest, layers.sum(axis=1))
    if (is_layer.sum(axis=1) > 1).any():
        top = np.argmax(layers * (res["kind_states"] + res["kind_activations"]), axis=1)[:, None]
        one = {name: np.take_along_axis(res[key], top, axis=1)[:, 0] for name, key in KIND_FLOORS.items()}
        count = np.take_along_axis(layers, top, axis=1)[:, 0]
        forced_one, slowest_one = _allocation_floors(pa, res, budget, one, count)
        forced, slowest = np.maximum(forced, forced_one), np.maximum(slowest, slowest_one)
    return forced, slowest


def _allocation_floors(pa: PlanArrays, res: dict, budget: float, layer: dict, count: np.ndarray):
    """`recompute_floors` for `count` layers each with at least a layer's figures `layer` (N,): states s (and,
    under zb, what each deferred W pass holds), activations a without recompute and c with the most, passes'
    seconds t, and h(d) = max(e1 d, e2 d + k) under the seconds of recompute that save d bytes of its
    activations (full recompute's alone under the zero-bubble schedules) (`_layer_floors`), and each rank's
    micro-batches in flight f_r (`micro_batches_kept`).

    Rank r holding n_r layers keeps at least the workspace, n_r s of states and f_r times their activations
    less what recompute saves, D_r: so D_r >= n_r (a + s / f_r) - B / f_r (B: the budget less the workspace)
    and n_r <= B / (s + f_r c); h is convex, so those savings cost at least n_r h(D_r / n_r) = max(e1 D_r,
    e2 D_r + k n_r): convex and piecewise linear in n_r, free up to B / (s + f_r a) layers. Dropping
    integrality and the contiguity of stages, the least total over sum n_r = L is a convex allocation (the
    ranks' pieces, cheapest first); the slowest rank is at least the least M at which the whole layers each
    rank can take within M seconds (its p2p and end blocks, n_r t, its recompute) cover L (`_whole_layers`).
    The ends' memory, tied copies, gathered blocks and buffers are left out: they only add memory, so both
    floors hold."""
    n = len(pa)
    col = lambda x: np.asarray(x, dtype=float)[:, None]  # noqa: E731
    finite = lambda x: np.where(np.isfinite(x), x, 0.0)  # noqa: E731  (nothing saves: then cap = free)
    sched, pp, m, v = (col(pa.columns[name]) for name in ("schedule", "pp", "num_micro_batches", "virtual_stages"))
    zb = zero_bubble.applies(sched)  # full recompute alone (`knobs._check_schedule`), and deferred W passes
    e1, e2, ef, k = (col(finite(layer[name])) for name in ("e1", "e2", "ef", "k"))
    e1, e2, k = np.where(zb, ef, e1), np.where(zb, ef, e2), np.where(zb, 0.0, k)
    a, c, L = col(layer["a"]), col(layer["c"]), col(count)
    t, B = col(np.maximum(layer["t"], 1e-12)), col(np.maximum(budget - res["workspace"], 0.0))
    rank = np.arange(int(pp.max()), dtype=float)[None, :]
    on = rank < pp  # the ranks of each plan (pp varies by row)
    f = np.maximum(micro_batches_kept(sched, pp, m, v, rank), 1e-9)
    s = col(layer["s"]) + zero_bubble.in_flight(sched, pp, m, v, rank)[1] * col(layer["h"])  # what recompute keeps
    q = a + s / f  # bytes to save for each layer beyond the free ones
    free = np.where(on, B / np.maximum(s + f * a, 1e-30), 0.0)
    cap = np.where(on, np.maximum(B / np.maximum(s + f * c, 1e-30), free), 0.0)
    lift = (e2 - e1) * q + k  # where > 0 the second line overtakes the first at `bend` layers
    bend = np.where(lift > 0, (e2 - e1) * B / f / np.where(lift > 0, lift, 1.0), np.inf)
    knee = np.clip(bend, free, cap)
    lengths = [free, knee - free, cap - knee]
    slopes = [np.zeros_like(free), e1 * q, np.where(lift > 0, e2 * q + k, e1 * q)]
    feasible = cap.sum(axis=1) >= L[:, 0] * (1 - 1e-12)
    # the least total: the convex allocation, the cheapest pieces first
    ln, sl = np.concatenate(lengths, axis=1), np.concatenate(slopes, axis=1)
    order = np.argsort(sl, axis=1, kind="stable")
    ln, sl = np.take_along_axis(ln, order, axis=1), np.take_along_axis(sl, order, axis=1)
    filled = np.clip(L - (np.cumsum(ln, axis=1) - ln), 0.0, ln)
    forced = np.where(feasible, (filled * sl).sum(axis=1), np.inf)
    # the least slowest rank: the layers the ranks can take within M seconds, sum_r n_r(M), is piecewise
    # linear in M, each rank's rate 1 / (t + slope) on its pieces from its p2p and end blocks on
    base = np.where(rank == 0, col(res["first_seconds"]), 0.0) + col(res["rank_p2p"])
    v_shaped = np.isin(sched, [SCHEDULES.index(name) for name in V_SCHEDULES])
    base = base + np.where(rank == np.where(v_shaped, 0.0, pp - 1), col(res["last_seconds"]), 0.0)
    base = np.where(on, base, HUGE)
    starts, rates = [base], []
    for length, slope in zip(lengths, slopes):
        rates.append(np.where(on, 1 / (t + slope), 0.0))
        starts.append(np.minimum(starts[-1] + length * (t + slope), HUGE))
    changes = [rates[0], rates[1] - rates[0], rates[2] - rates[1], -rates[2]]
    at, change = np.concatenate(starts, axis=1), np.concatenate(changes, axis=1)
    order = np.argsort(at, axis=1, kind="stable")
    at, change = np.take_along_axis(at, order, axis=1), np.take_along_axis(change, order, axis=1)
    rate = np.maximum(np.cumsum(change, axis=1), 0.0)  # after each point (>= 0: rounding left past the pieces)
    held = np.concatenate([np.zeros((n, 1)), np.cumsum(rate[:, :-1] * np.diff(at, axis=1), axis=1)], axis=1)
    i = np.minimum((held < L).sum(axis=1) - 1, at.shape[1] - 1)[:, None]  # the last point below L layers
    h_i, at_i, rate_i = (np.take_along_axis(x, i, axis=1)[:, 0] for x in (held, at, rate))
    least = at_i + (L[:, 0] - h_i) / np.where(rate_i > 0, rate_i, np.inf)
    # caps that cover L only to rounding: every rank at its cap, so the slowest at the last piece's end
    ends = np.where(on, starts[-1], 0.0).max(axis=1)
    least = np.where(at_i >= HUGE / 2, ends, np.minimum(least, ends))
    least = _whole_layers(least, base, t, lengths, slopes, on, L[:, 0])
    slowest = np.where(feasible, np.maximum(least, np.where(on, base, 0.0).max(axis=1)), np.inf)
    return forced, slowest


def _whole_layers(least: np.ndarray, base, t, lengths: list, slopes: list, on, L: np.ndarray) -> np.ndarray:
    """The least slowest rank with whole layers on each rank: at `least` (the fractional crossing) the ranks
    hold their layers rounded down, and the layers still to place go, one at a time, to the rank whose next
    layer ends soonest (each rank's times to hold k layers rise with k: so the last placed is the least M at
    which the ranks can hold L whole layers)."""
    steps = [(length, t + slope) for length, slope in zip(lengths, slopes)]

    def held(M):  # layers each rank takes within M
        room, out = np.maximum(M[:, None] - base, 0.0), np.zeros_like(base)
        for length, each in steps:
            part = np.minimum(room / each, length)
            out, room = out + part, room - part * each
        return np.where(on & (M[:, None] >= base), out, 0.0)

    def time_to_hold(k):  # inf beyond a rank's cap
        out, left = base.copy(), k.astype(float)
        for length, each in steps:
            part = np.minimum(left, length)
            out, left = out + part * each, left - part
        return np.where(on & (left <= 1e-9), out, np.inf)

    cap = np.floor(sum(length for length, _ in steps) + 1e-9)
    count = np.minimum(np.floor(held(least) + 1e-9), cap)
    missing = L - count.sum(axis=1)
    rows = np.arange(len(L))
    for _ in range(int(missing.max(initial=0))):
        nxt = time_to_hold(count + 1)
        r = np.argmin(nxt, axis=1)
        due = (missing > 0) & np.isfinite(nxt[rows, r])
        least = np.where(due, np.maximum(least, nxt[rows, r]), least)
        count[rows[due], r[due]] += 1
        missing = missing - due
    return least


def outer_bounds(workload, plans: list[Plan], coeffs: Coefficients | None = None) -> np.ndarray:
    """`lower_bound` of each outer plan of `plans`, priced here (one `evaluate(..., ranks=True)` call)."""
    pa = PlanArrays.from_plans(plans, workload.profile)
    return lower_bound(pa, evaluate(workload, pa, coeffs, ranks=True), workload.memory_budget)


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
            for stage, e in zip(rank_stages(problem.pp, problem.v, plan.schedule, r), pattern):
                entries[stage] = e
        entries = tuple(entries)
    if all(split) and split == balanced_split(problem.layers, len(split)):
        split = ()
    if all(e == "none" for e in entries):
        entries = ()
    return plan.with_(layer_split=split, stage_recompute=entries)
