"""Plans as a structure of NumPy arrays, so the cost model evaluates many plans per call.

One column per Plan field (`autopar.knobs.plan_fields()`), named as the field: categorical
fields hold the index of their value, the mesh order an index into `mesh_order_code`'s table
(declared orders first). The pipeline layer split, which has a different length per plan,
becomes an index into a small table of splits (`SplitTable`), each reduced to the classes of
pipeline ranks that can be the bottleneck (see `SplitTable.add`).
"""

from __future__ import annotations

import numpy as np

from autopar import axes
from autopar.knobs import (COMM_DTYPES, DTYPE_BYTES, SCHEDULES, V_SCHEDULES, Field, balanced_split, plan_fields,
                           stage_full_blocks, stage_rank)
from autopar.plan import Plan
from autopar.profile.model_profile import ModelProfile

DTYPE_BYTES_BY_CODE = np.array([DTYPE_BYTES[d] for d in COMM_DTYPES])  # grad_comm_dtype code -> bytes
_ORDERS: list[tuple[str, ...]] = []  # mesh order codes: the declared orders, then any other met


def _reset_orders() -> None:
    _ORDERS[:] = list(axes.mesh_orders())


axes.on_change(_reset_orders)
_reset_orders()


def mesh_order_code(order: tuple[str, ...]) -> int:
    order = tuple(order)
    if order not in _ORDERS:
        _ORDERS.append(order)
    return _ORDERS.index(order)


def mesh_order_of(code: int) -> tuple[str, ...]:
    return _ORDERS[int(code)]


def unique_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Index of the first row of each distinct row of `columns` and each row's distinct id, through
    one integer key per row (a mixed-radix number of the columns' value codes): a sort of one
    int64 array instead of np.unique over rows."""
    n = len(columns[0]) if columns else 0
    key, radix = np.zeros(n, dtype=np.int64), 1
    for col in columns:
        col = np.asarray(col)
        if col.dtype.kind in "biu" and n and col.min() >= 0 and col.max() < 1 << 20:
            codes, size = col.astype(np.int64), int(col.max()) + 1
        else:
            uniq, codes = np.unique(col, return_inverse=True)
            codes, size = codes.reshape(-1).astype(np.int64), len(uniq)
        if radix * size >= 1 << 62:  # keep the key in range: renumber what is distinct so far
            _, key = np.unique(key, return_inverse=True)
            key, radix = key.reshape(-1).astype(np.int64), int(key.max(initial=0)) + 1
        key, radix = key * size + codes, radix * size
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


_TUPLES: dict[str, list[tuple]] = {}  # other tuple fields (stage_recompute): codes of the values met, () first


def encode(f: Field, value):
    """A field's value as a number of its column."""
    if f.values is not None:
        return f.values.index(value)
    if f.name == "mesh_order":
        return mesh_order_code(value)
    if f.kind is tuple:
        table = _TUPLES.setdefault(f.name, [()])
        if tuple(value) not in table:
            table.append(tuple(value))
        return table.index(tuple(value))
    return value


def decode(f: Field, code):
    if f.values is not None:
        return f.values[int(code)]
    if f.name == "mesh_order":
        return mesh_order_of(code)
    if f.kind is tuple:
        return _TUPLES.setdefault(f.name, [()])[int(code)]
    return f.kind(code.item() if hasattr(code, "item") else code)


class SplitTable:
    """Distinct (pp, virtual stages, layer split, per-stage recompute) keys and, per key, the pipeline
    ranks that matter: one representative (the lowest rank) of each class of ranks holding the same
    blocks, recomputed alike, and the same ends of the model, with the class's highest rank (`last`).
    The lowest rank of a class keeps the most micro-batches in flight under every schedule but zb, whose
    deferred weight-gradient passes grow with the rank: there memory is the class's worst over [rank,
    last] (`zero_bubble.worst_in_flight`), so memory and time maxima over these ranks are exact.

    Per representative rank and block kind: `counts` (blocks held; the embedding and head count as
    their kinds), and for a per-stage recompute (`staged`) `full` (blocks fully recomputed: a stage's
    "full:K" its first K) and `sel` (blocks selectively recomputed); a uniform plan's recompute is
    priced from its `recompute` fields instead. `add_rank` adds one rank alone (the per-stage solver
    prices ranks, not whole splits)."""

    def __init__(self, profile: ModelProfile):
        self.profile = profile
        self.kinds = profile.blocks  # embed, layer kinds..., head
        self._index: dict[tuple, int] = {}
        self.entries: list[dict] = []
        self._stacked: tuple[int, dict] | None = None
        self.kind_of_layer = np.array([k for k, entry in enumerate(profile.layers, start=1) for _ in range(entry.count)],
                                      dtype=np.int64)
        # blocks of each kind among the first i: a stage's blocks by kind are a difference of two rows
        self.before = np.vstack([np.zeros(len(self.kinds)), np.cumsum(np.eye(len(self.kinds))[self.kind_of_layer], axis=0)])

    def add(self, pp: int, v: int, split: tuple[int, ...], stage_recompute: tuple[str, ...] = (),
            schedule: str = "1f1b") -> int:
        """`schedule` places the stages on the ranks (`knobs.stage_rank`: looped, or a V for zbv / dualpipev)."""
        schedule = "zbv" if schedule in V_SCHEDULES else "1f1b"  # the placement is all the key needs
        key = (pp, v, split, stage_recompute, schedule)
        if key in self._index:
            return self._index[key]
        counts, full, sel = self.per_rank(pp, split, stage_recompute, schedule)
        reps, mult, last = [], {}, {}
        for d in range(pp):
            sig = (counts[d].tobytes(), full[d].tobytes(), sel[d].tobytes(), d == 0, d == pp - 1)
            if sig not in mult:
                mult[sig] = 0
                reps.append(d)
            mult[sig] += 1
            last[sig] = d
        return self._append(key, pp, v, split, reps, counts, full, sel, list(mult.values()), bool(stage_recompute),
                            last=list(last.values()))

    def per_rank(self, pp: int, split: tuple[int, ...], stage_recompute: tuple[str, ...] = (),
                 schedule: str = "1f1b") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pp, K) each pipeline rank's blocks by kind (ends included), and those recomputed fully and
        selectively, before `add` folds ranks alike into classes (a mixed plan's lane prices every rank)."""
        schedule = "zbv" if schedule in V_SCHEDULES else "1f1b"
        n_kinds = len(self.kinds)
        counts, full, sel = (np.zeros((pp, n_kinds)) for _ in range(3))
        start = 0
        for stage, n in enumerate(split):
            rank = stage_rank(stage, pp, schedule)
            held = self.before[start + n] - self.before[start]
            counts[rank] += held
            entry = stage_recompute[stage] if stage_recompute else "none"
            if entry == "selective":
                sel[rank] += held
            elif entry.startswith("full:"):
                full[rank] += self.before[start + stage_full_blocks(entry)] - self.before[start]
            start += n
        counts[0, 0] += 1  # embedding on the first rank
        counts[stage_rank(len(split) - 1, pp, schedule), -1] += 1  # head with the last stage (rank 0 in a V)
        return counts, full, sel

    def add_rank(self, pp: int, v: int, rank: int, counts: np.ndarray, full: np.ndarray, sel: np.ndarray) -> int:
        """One pipeline rank alone (multiplicity 1), with its blocks by kind (ends included) and those
        recomputed fully and selectively: what the per-stage solver prices, rank by rank."""
        key = ("rank", pp, v, rank, counts.tobytes(), full.tobytes(), sel.tobytes())
        if key in self._index:
            return self._index[key]
        one = lambda a: np.asarray(a, dtype=float)[None, :]  # noqa: E731
        split = (int(counts[1:-1].sum()),)
        return self._append(key, pp, v, split, [0], one(counts), one(full), one(sel), [1], True, rank=rank)

    def _append(self, key, pp, v, split, reps, counts, full, sel, mult, staged, rank=None, last=None) -> int:
        self._index[key] = len(self.entries)
        ranks = np.array(reps) if rank is None else np.array([rank])
        layers = counts[reps][:, 1:-1].sum(axis=1) if rank is None else counts[:, 1:-1].sum(axis=1)
        self.entries.append({
            "pp": pp, "v": v, "split": split, "stage_recompute": key[3] if rank is None else None,
            "ranks": ranks, "last": ranks if last is None else np.array(last),
            "counts": counts[reps], "full": full[reps], "sel": sel[reps],
            "mult": np.array(mult, dtype=float), "layers": layers, "staged": staged,
        })
        return self._index[key]

    def add_balanced(self, pp: np.ndarray, v: np.ndarray, schedule: np.ndarray | None = None) -> np.ndarray:
        """The split id of the balanced split of every (pp, v, schedule code) triple (the schedule
        places the stages)."""
        codes = np.zeros_like(pp) if schedule is None else np.asarray(schedule, dtype=np.int64)
        first, inverse = unique_rows([pp, v, codes])
        layers = self.profile.num_layers
        ids = np.array([self.add(int(pp[i]), int(v[i]), balanced_split(layers, int(pp[i] * v[i])),
                                 schedule=SCHEDULES[int(codes[i])]) for i in first], dtype=np.int64)
        return ids[inverse]

    def stacked(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per plan, the representative ranks padded to a common width (padding repeats the
        first representative, which changes no maximum, with multiplicity 0), and whether its
        recompute is per stage (`staged`). Built once per table size."""
        if self._stacked is None or self._stacked[0] != len(self.entries):
            width = max(len(e["ranks"]) for e in self.entries)
            n_kinds = len(self.kinds)
            shape = (len(self.entries), width)
            ranks, last, layers, mult = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
            counts, full, sel = (np.zeros(shape + (n_kinds,)) for _ in range(3))
            for i, e in enumerate(self.entries):
                n = len(e["ranks"])
                for name, value in (("ranks", ranks), ("last", last), ("counts", counts), ("full", full),
                                    ("sel", sel), ("layers", layers)):
                    value[i, :n] = e[name]
                    value[i, n:] = e[name][0]
                mult[i, :n] = e["mult"]
            staged = np.array([e["staged"] for e in self.entries], dtype=bool)
            self._stacked = (len(self.entries), {"rank": ranks, "last": last, "counts": counts, "layers": layers,
                                                  "mult": mult,
                                                  "full": full, "sel": sel, "staged": staged})
        return {name: value[ids] for name, value in self._stacked[1].items()}


class RankTable:
    """Plans given rank by rank, built in bulk: entry i holds `ranks[i]` (pipeline positions, each of
    multiplicity `mult`, default 1) with their blocks by kind (`counts`, ends included) and those
    recomputed fully (`full`) and selectively (`sel`); 1-D `ranks` make one rank per entry. What the
    per-stage solver (autopar/search/stages.py) prices: `evaluate` reads a table only through `stacked`,
    so each rank is priced by the very functions that price whole plans."""

    def __init__(self, ranks: np.ndarray, counts: np.ndarray, full: np.ndarray, sel: np.ndarray,
                 mult: np.ndarray | None = None):
        ranks = np.asarray(ranks, dtype=float)
        if ranks.ndim == 1:
            ranks, counts, full, sel = ranks[:, None], counts[:, None, :], full[:, None, :], sel[:, None, :]
        self._arrays = {"rank": ranks, "last": ranks, "counts": counts, "layers": counts[:, :, 1:-1].sum(axis=2),
                        "mult": np.ones_like(ranks) if mult is None else mult, "full": full, "sel": sel,
                        "staged": np.ones(len(ranks), dtype=bool)}

    def stacked(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {name: value[ids] for name, value in self._arrays.items()}


class PlanArrays:
    """A batch of plans for one workload: one array per Plan field (attribute access by field
    name, `pa.micro_batch_size`), all of the same length, plus `split` into `splits`."""

    def __init__(self, columns: dict[str, np.ndarray], splits: SplitTable):
        self.columns = {name: np.asarray(value) for name, value in columns.items()}
        self.splits = splits

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(f"PlanArrays has no column {name!r}") from None

    def __len__(self) -> int:
        return len(self.columns["split"])

    @staticmethod
    def names() -> list[str]:
        return [f.name for f in plan_fields()] + ["split"]

    @classmethod
    def from_plans(cls, plans: list[Plan], profile: ModelProfile) -> PlanArrays:
        table = SplitTable(profile)
        cols: dict[str, list] = {name: [] for name in cls.names()}
        for p in plans:
            for f in plan_fields():
                cols[f.name].append(encode(f, getattr(p, f.name)))
            cols["split"].append(table.add(p.pp, p.virtual_stages, p.split_for(profile.num_layers), p.stage_recompute,
                                           p.schedule))
        return cls({k: np.asarray(v) for k, v in cols.items()}, table)

    @classmethod
    def empty(cls, table: SplitTable) -> PlanArrays:
        return cls({k: np.zeros(0, dtype=np.int64) for k in cls.names()}, table)

    def plan(self, i: int) -> Plan:
        """The i-th plan back as a Plan (the layer split is written out explicitly only when it
        differs from the balanced default)."""
        values = {f.name: decode(f, self.columns[f.name][i]) for f in plan_fields()}
        split = self.splits.entries[int(self.columns["split"][i])]["split"]
        if split != balanced_split(sum(split), values["pp"] * values["virtual_stages"]):
            values["layer_split"] = split
        return Plan(**values)

    def recomputes_every_block(self) -> np.ndarray:
        """Per plan, whether its recompute count covers every block of its busiest stage (full
        recompute as Megatron's `--recompute-granularity full --recompute-method uniform` runs it):
        one maximum per split, not per plan (a space holds millions of plans and a few hundred splits)."""
        most = np.array([e["layers"].max() for e in self.splits.entries]) if self.splits.entries else np.zeros(0)
        return self.recompute_blocks == most[self.split] if len(self) else np.zeros(0, dtype=bool)

    @classmethod
    def joined(cls, parts: list[PlanArrays]) -> PlanArrays:
        """Plans of several batches sharing one split table (walks of one space), as one batch."""
        if len(parts) == 1:
            return parts[0]
        return cls({k: np.concatenate([pa.columns[k] for pa in parts]) for k in parts[0].columns}, parts[0].splits)

    def take(self, index: np.ndarray) -> PlanArrays:
        """A subset (by boolean mask or indices) sharing the split table."""
        return PlanArrays({k: v[index] for k, v in self.columns.items()}, self.splits)
