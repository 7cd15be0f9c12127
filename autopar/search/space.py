"""The plan space of a workload: the choices of every knob given the earlier ones.

One definition serves every planner: the exhaustive oracle enumerates it, the rules pick in it,
and the RL environment and Optuna walk it knob by knob. Knobs that cannot matter are pinned to
one canonical value (no ZeRO, bucket or gradient dtype without data parallelism; no sequence
parallel without tensor parallelism) so the space holds no duplicate plans.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from autopar.capability import sequence_parallel_options
from autopar.cost.arrays import MESH_ORDERS, PlanArrays, SplitTable
from autopar.errors import AutoparError
from autopar.plan import COMM_DTYPES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, balanced_split, device_blocks

BUCKETS_MB = (5.0, 25.0, 100.0)
MAX_VIRTUAL_STAGES = 8
MAX_PLANS = 10_000_000  # rows of PlanArrays one enumeration may build (~1.5 GB); a 175B GPT on 1,024 GPUs has 1.5M
TP_INNER, DP_INNER = MESH_ORDERS.index(("pp", "dp", "tp")), MESH_ORDERS.index(("pp", "tp", "dp"))


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, found up to sqrt(n) (n may be a large batch)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_choices(workload) -> list[int]:
    """Degrees that divide the GPU count and every tensor-parallel unit (heads, sharded dims)."""
    profile = workload.profile
    if not profile.has_tp_plan:
        return [1]
    return [t for t in divisors(workload.world_size) if all(u % t == 0 for u in profile.tp_units)
            and sequence_parallel_options(profile, t)]


def degree_choices(workload) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp x tp x pp = GPUs, pp <= blocks and dp dividing the global batch."""
    n, layers, batch = workload.world_size, workload.profile.num_layers, workload.global_batch
    out = []
    for tp in tp_choices(workload):
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp <= layers and batch % dp == 0 and (pp == 1 or "pp" not in workload.profile.limits):
                out.append((dp, tp, pp))
    return out


def micro_batch_choices(workload, dp: int) -> list[int]:
    return divisors(workload.global_batch // dp)


def schedule_choices(workload, pp: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages). Interleaving needs micro-batches divisible by pp and an even
    number of blocks per chunk, as Megatron-LM's interleaved schedule does."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1)]
    if num_micro_batches >= pp:
        out.append(("1f1b", 1))
        layers = workload.profile.num_layers
        if num_micro_batches % pp == 0:
            out += [("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if layers % (pp * v) == 0]
    return out


def recompute_choices(workload, pp: int, v: int) -> list[tuple[str, int]]:
    """(mode, checkpointed blocks per pipeline rank): none, selective when the model has an
    attention core, and full recompute of 1 ... all blocks of the busiest rank (every count up to
    16, then a geometric grid, always including all)."""
    out = [("none", 0)]
    if any(b.attn_core_bytes > 0 for b in workload.profile.layers):
        out.append(("selective", 0))
    most = max(device_blocks(balanced_split(workload.profile.num_layers, pp * v), pp))
    counts = set(range(1, min(most, 16) + 1))
    counts |= {int(round(most * f / 16)) for f in range(1, 17)}
    out += [("full", n) for n in sorted(c for c in counts if 1 <= c <= most)]
    return out


def _data_parallel_options(workload, dp: int, tp: int) -> np.ndarray:
    """Rows of (zero, bucket_mb, comm dtype code, offload, mesh order code, sequence parallel)."""
    precision = workload.precision
    sp_opts = sequence_parallel_options(workload.profile, tp)
    if dp == 1:
        return np.array([(0, BUCKETS_MB[1], COMM_DTYPES.index("fp32"), 0, TP_INNER, sp) for sp in sp_opts],
                        dtype=float)
    comms = [COMM_DTYPES.index("fp32")]
    gloo = workload.cluster.node.intra == "shm"  # CPU processes: gloo has no bf16, the host is the device
    if precision == "fp16" or (precision == "bf16" and not gloo):
        comms.append(COMM_DTYPES.index(precision))
    orders = (TP_INNER, DP_INNER) if tp > 1 else (TP_INNER,)
    rows = []
    for zero in (0, 1, 2, 3):
        buckets = BUCKETS_MB if zero <= 1 else (BUCKETS_MB[1],)
        offloads = (0, 1) if zero >= 2 and not gloo else (0,)
        rows += itertools.product([zero], buckets, comms, offloads, orders, sp_opts)
    return np.array(rows, dtype=float)


INNER = ("zero", "bucket_mb", "comm", "offload", "order", "sp")  # columns of _data_parallel_options
OUTER = ("dp", "tp", "pp", "mbs", "nmb", "schedule", "v", "precision", "split")


def enumerate_plans(workload) -> PlanArrays:
    """Every plan of the space as PlanArrays: a Python loop over degrees, micro-batches and
    schedules; NumPy over the recompute and data-parallel knobs inside each."""
    profile = workload.profile
    table = SplitTable(profile)
    precision = PRECISIONS.index(workload.precision)
    cols: dict[str, list[np.ndarray]] = {name: [] for name in OUTER + INNER + ("recompute", "recompute_blocks", "group")}
    next_group = total = 0
    for dp, tp, pp in degree_choices(workload):
        inner = _data_parallel_options(workload, dp, tp)
        # plans differing only in ZeRO, bucket, gradient dtype or offload share a cost-model group
        _, inner_group = np.unique(inner[:, 4:6], axis=0, return_inverse=True)
        inner_group = inner_group.reshape(-1)
        for mbs in micro_batch_choices(workload, dp):
            nmb = workload.global_batch // (dp * mbs)
            for schedule, v in schedule_choices(workload, pp, nmb):
                split_id = table.add(pp, v, balanced_split(profile.num_layers, pp * v))
                rc = np.array([(RECOMPUTE_MODES.index(m), n) for m, n in recompute_choices(workload, pp, v)])
                n_rc, size = len(rc), len(inner) * len(rc)
                total += size
                if total > MAX_PLANS:  # bounded memory and time, whatever the workload
                    raise AutoparError(f"the plan space of {workload.describe()} has more than {MAX_PLANS:,} plans; "
                                       f"autopar enumerates at most {MAX_PLANS:,}: use --method rl, optuna or "
                                       f"random, which sample it, or fewer GPUs or a smaller global batch")
                for name, value in zip(OUTER, (dp, tp, pp, mbs, nmb, SCHEDULES.index(schedule), v, precision,
                                               split_id)):
                    cols[name].append(np.full(size, value, dtype=np.int64))
                for j, name in enumerate(INNER):
                    cols[name].append(np.repeat(inner[:, j], n_rc))
                cols["recompute"].append(np.tile(rc[:, 0], len(inner)))
                cols["recompute_blocks"].append(np.tile(rc[:, 1], len(inner)))
                cols["group"].append(next_group + np.repeat(inner_group, n_rc) * n_rc + np.tile(np.arange(n_rc),
                                                                                               len(inner)))
                next_group += (int(inner_group.max()) + 1) * n_rc
    if not cols["dp"]:
        return PlanArrays.empty(table)
    a = {name: np.concatenate(parts) for name, parts in cols.items()}
    for name in ("zero", "comm", "order"):
        a[name] = a[name].astype(np.int64)
    for name in ("offload", "sp"):
        a[name] = a[name].astype(bool)
    return PlanArrays(**a, splits=table)
