"""Plans as a structure of NumPy arrays, so the cost model evaluates many plans per call.

Knobs become integer codes; the pipeline layer split, which has a different length per plan,
becomes an index into a small table of splits (`SplitTable`), each reduced to the classes of
pipeline ranks that can be the bottleneck (see `SplitTable.add`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.plan import COMM_DTYPES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, Plan, balanced_split, device_blocks
from autopar.profile.model_profile import ModelProfile

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_BYTES_BY_CODE = np.array([DTYPE_BYTES[d] for d in COMM_DTYPES])  # COMM_DTYPES == PRECISIONS as sets
MESH_ORDERS = (("pp", "dp", "tp"), ("pp", "tp", "dp"), ("dp", "pp", "tp"), ("tp", "pp", "dp"),
               ("dp", "tp", "pp"), ("tp", "dp", "pp"))


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


@dataclass
class PlanArrays:
    """A batch of plans for one workload; every field is an array of the same length."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    mbs: np.ndarray
    nmb: np.ndarray
    order: np.ndarray  # index into MESH_ORDERS
    zero: np.ndarray
    bucket_mb: np.ndarray
    recompute: np.ndarray  # index into RECOMPUTE_MODES
    recompute_blocks: np.ndarray
    schedule: np.ndarray  # index into SCHEDULES
    v: np.ndarray
    sp: np.ndarray
    precision: np.ndarray  # index into PRECISIONS
    comm: np.ndarray  # index into COMM_DTYPES: dtype of the gradient reduction
    offload: np.ndarray
    split: np.ndarray  # index into `splits`
    splits: SplitTable
    group: np.ndarray | None = None  # plans with equal group differ only in data-parallel knobs

    def __len__(self) -> int:
        return len(self.dp)

    @classmethod
    def from_plans(cls, plans: list[Plan], profile: ModelProfile) -> PlanArrays:
        table = SplitTable(profile)
        cols: dict[str, list] = {name: [] for name in cls._columns()}
        for p in plans:
            cols["dp"].append(p.dp)
            cols["tp"].append(p.tp)
            cols["pp"].append(p.pp)
            cols["mbs"].append(p.micro_batch_size)
            cols["nmb"].append(p.num_micro_batches)
            cols["order"].append(MESH_ORDERS.index(tuple(p.mesh_order)))
            cols["zero"].append(p.zero)
            cols["bucket_mb"].append(p.bucket_mb)
            cols["recompute"].append(RECOMPUTE_MODES.index(p.recompute))
            cols["recompute_blocks"].append(p.recompute_blocks)
            cols["schedule"].append(SCHEDULES.index(p.schedule))
            cols["v"].append(p.virtual_stages)
            cols["sp"].append(p.sequence_parallel)
            cols["precision"].append(PRECISIONS.index(p.precision))
            cols["comm"].append(COMM_DTYPES.index(p.grad_comm_dtype))
            cols["offload"].append(p.offload_optimizer)
            cols["split"].append(table.add(p.pp, p.virtual_stages, p.split_for(profile.num_layers)))
        arrays = {k: np.asarray(v) for k, v in cols.items()}
        return cls(**arrays, splits=table)

    @classmethod
    def _columns(cls) -> list[str]:
        return [name for name in cls.__dataclass_fields__ if name not in ("splits", "group")]

    @classmethod
    def empty(cls, table: SplitTable) -> PlanArrays:
        return cls(**{k: np.zeros(0, dtype=np.int64) for k in cls._columns()}, splits=table)

    def plan(self, i: int) -> Plan:
        """The i-th plan back as a Plan (the layer split is written out explicitly only when it
        differs from the balanced default)."""
        entry = self.splits.entries[int(self.split[i])]
        pp, v = int(self.pp[i]), int(self.v[i])
        split = entry["split"]
        return Plan(
            dp=int(self.dp[i]), tp=int(self.tp[i]), pp=pp, micro_batch_size=int(self.mbs[i]),
            num_micro_batches=int(self.nmb[i]), mesh_order=MESH_ORDERS[int(self.order[i])],
            zero=int(self.zero[i]), bucket_mb=float(self.bucket_mb[i]),
            recompute=RECOMPUTE_MODES[int(self.recompute[i])], recompute_blocks=int(self.recompute_blocks[i]),
            schedule=SCHEDULES[int(self.schedule[i])], virtual_stages=v,
            layer_split=() if split == balanced_split(sum(split), pp * v) else split,
            sequence_parallel=bool(self.sp[i]), precision=PRECISIONS[int(self.precision[i])],
            grad_comm_dtype=COMM_DTYPES[int(self.comm[i])],
            offload_optimizer=bool(self.offload[i]),
        )

    def take(self, index: np.ndarray) -> PlanArrays:
        """A subset (by boolean mask or indices) sharing the split table."""
        data = {k: getattr(self, k)[index] for k in self._columns()}
        group = None if self.group is None else self.group[index]
        return PlanArrays(**data, splits=self.splits, group=group)

