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
from autopar.knobs import COMM_DTYPES, DTYPE_BYTES, Field, balanced_split, device_blocks, plan_fields
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
    """Distinct (pp, virtual stages, layer split) triples and, per split, the pipeline ranks
    that matter: one representative (the lowest rank) of each class of ranks holding the same
    blocks and the same ends of the model. The lowest rank of a class keeps the most
    micro-batches in flight, so memory and time maxima over these ranks are exact."""

    def __init__(self, profile: ModelProfile):
        self.profile = profile
        self.kinds = profile.blocks  # embed, layer kinds..., head
        self._index: dict[tuple, int] = {}
        self.entries: list[dict] = []

    def add(self, pp: int, v: int, split: tuple[int, ...]) -> int:
        key = (pp, v, split)
        if key in self._index:
            return self._index[key]
        kind_of_layer = []
        for k, entry in enumerate(self.profile.layers, start=1):
            kind_of_layer += [k] * entry.count
        counts = np.zeros((pp, len(self.kinds)))
        start = 0
        for stage, n in enumerate(split):
            for k in kind_of_layer[start:start + n]:
                counts[stage % pp, k] += 1
            start += n
        counts[0, 0] += 1  # embedding on the first rank
        counts[pp - 1, -1] += 1  # head on the last rank
        reps, mult = [], {}
        for d in range(pp):
            sig = (tuple(counts[d]), d == 0, d == pp - 1)
            if sig not in mult:
                mult[sig] = 0
                reps.append(d)
            mult[sig] += 1
        self._index[key] = len(self.entries)
        self.entries.append({
            "pp": pp, "v": v, "split": split, "ranks": np.array(reps), "counts": counts[reps],
            "mult": np.array(list(mult.values()), dtype=float),
            "layers": np.array([device_blocks(split, pp)[d] for d in reps]),
        })
        return self._index[key]

    def add_balanced(self, pp: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The split id of the balanced split of every (pp, v) pair."""
        first, inverse = unique_rows([pp, v])
        layers = self.profile.num_layers
        ids = np.array([self.add(int(pp[i]), int(v[i]), balanced_split(layers, int(pp[i] * v[i]))) for i in first],
                       dtype=np.int64)
        return ids[inverse]

    def stacked(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per plan, the representative ranks padded to a common width (padding repeats the
        first representative, which changes no maximum, with multiplicity 0)."""
        width = max(len(e["ranks"]) for e in self.entries)
        n_kinds = len(self.kinds)
        ranks = np.zeros((len(self.entries), width))
        counts = np.zeros((len(self.entries), width, n_kinds))
        layers = np.zeros((len(self.entries), width))
        mult = np.zeros((len(self.entries), width))
        for i, e in enumerate(self.entries):
            pad = [0] * (width - len(e["ranks"]))
            ranks[i] = np.concatenate([e["ranks"], e["ranks"][pad]])
            counts[i] = np.concatenate([e["counts"], e["counts"][pad]])
            layers[i] = np.concatenate([e["layers"], e["layers"][pad]])
            mult[i, :len(e["ranks"])] = e["mult"]
        return {"rank": ranks[ids], "counts": counts[ids], "layers": layers[ids], "mult": mult[ids]}


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
            cols["split"].append(table.add(p.pp, p.virtual_stages, p.split_for(profile.num_layers)))
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

    def take(self, index: np.ndarray) -> PlanArrays:
        """A subset (by boolean mask or indices) sharing the split table."""
        return PlanArrays({k: v[index] for k, v in self.columns.items()}, self.splits)
