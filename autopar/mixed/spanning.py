"""One pipeline spanning every group of a mixed cluster (issue 42, the mixed search's third kind of plan).

A spanning lane is dp replicas of a 1F1B pipeline whose stages run, in some order of the groups, on each
group's GPUs at that group's tensor-parallel degree: group g holds stages_g = gpus_g / (dp x tp_g) stages
(every GPU used). The configurations walked: every order of the groups (up to 3 groups; beyond, slowest
first and fastest first), every common dp and per-group tp that divides the groups, micro-batches of 1 or 2,
and the leanest recompute that fits (none, else full recompute of the busiest stage's blocks); ZeRO-1 where
dp > 1. A configuration's blocks go to groups in proportion to each group's speed (Metis's rule: its
single plan's tokens/s, else its GPUs' peak FLOP/s), evenly over the group's stages.

The exact part (exact=True): for the TOP configurations by that split, every count of blocks per group
(balanced within the group's stages) when there are at most MAX_SPLITS such splits, else the counts within
NEAR blocks of Metis's. Not exact: uneven blocks within a group, per-stage recompute, other knobs (ZeRO
stage, sequence parallelism, interleaving), and the configurations outside the TOP.
"""

from __future__ import annotations

import itertools
import math
import time

from autopar.errors import PlanError
from autopar.knobs import FP8_RECIPES, balanced_split
from autopar.mixed.cost import lane_time
from autopar.mixed.plan import Lane, Segment
from autopar.plan import Plan

TOP = 4  # configurations whose blocks per group the exact search walks
MAX_SPLITS = 64  # splits of blocks over groups walked in full; beyond, those within NEAR of Metis's
NEAR = 2
MICRO_BATCHES = (1, 2)
QUICK_KEEP = 4  # quick walks: the degrees (of the first order's walk) walked in every other order of the groups


def search_spanning(mw, speed: dict, exact: bool = True, deadline: float = math.inf, top: int = TOP,
                    walk_deadline: float = math.inf, quick: bool = False) -> Lane | None:
    """The fastest spanning lane found at the whole batch (see the module docstring), or None when none fits.
    `speed`: group -> tokens/s of its single plan (groups without one fall back on peak FLOP/s); `top`: the
    configurations whose splits the exact part walks; past `walk_deadline` (or `deadline`) the walk of
    configurations stops with those priced, past `deadline` the exact part too. `quick` (the rl search's):
    the degrees and micro-batching walked in the first order of the groups only, and the QUICK_KEEP best of
    them in every other order (the order of the groups is walked for those alone)."""
    names = mw.cluster.group_names
    blocks = mw.profile.num_layers
    rate = _rates(mw, speed)
    orders = _orders(names, rate)
    stop = min(deadline, walk_deadline)
    if not quick or len(orders) == 1:
        ranked = _walk(mw, _configs(mw, orders, blocks), rate, blocks, stop)
    else:
        ranked = sorted(_walk(mw, _configs(mw, orders[:1], blocks), rate, blocks, stop), key=lambda r: r[0])
        keep = {_degrees_of(r[1]) for r in ranked[:QUICK_KEEP]}
        others = (c for c in _configs(mw, orders[1:], blocks) if _degrees_of(c) in keep)
        ranked += _walk(mw, others, rate, blocks, stop)
    if not ranked:
        return None
    ranked.sort(key=lambda r: r[0])
    best_time, _, _, best = ranked[0]
    if not exact:
        return best
    for _, config, metis, _ in ranked[:top]:
        for split in _splits(blocks, config[3], metis):
            if split == metis:
                continue
            if time.perf_counter() > deadline:
                return best
            found = _price(mw, config, split)
            if found is not None and found[0] < best_time:
                best_time, best = found
    return best


def _walk(mw, configs, rate: dict, blocks: int, stop: float) -> list:
    """(seconds, config, split, lane) of each configuration that fits at Metis's split; past `stop` the walk
    ends (once one is priced)."""
    ranked = []
    for config in configs:
        if time.perf_counter() > stop and ranked:
            break
        split = _metis_split(blocks, [rate[g] for g in config[0]], config[3])
        found = _price(mw, config, split)
        if found is not None:
            ranked.append((found[0], config, split, found[1]))
    return ranked


def _degrees_of(config) -> tuple:
    """A configuration without its order of the groups: dp, each group's tp, the micro-batch size."""
    order, dp, tps, _, mbs = config
    return dp, frozenset(zip(order, tps)), mbs


def _configs(mw, orders, blocks: int):
    """(order, dp, per-group tp, per-group stages, micro-batch size) of every spanning lane walked."""
    for order in orders:
        for dp, tps in _degrees(mw, order):
            stages = tuple(mw.cluster.group(g).num_gpus // (dp * tp) for g, tp in zip(order, tps))
            if sum(stages) > blocks:
                continue
            for mbs in MICRO_BATCHES:
                if mw.global_batch % (dp * mbs) == 0:
                    yield order, dp, tuple(tps), stages, mbs


def _rates(mw, speed: dict) -> dict[str, float]:
    """Each group's speed (Metis: measured): its single plan's tokens/s where every group has one, else the
    sum of its GPUs' peak FLOP/s in the run's precision (one scale for all groups)."""
    names = mw.cluster.group_names
    if all(g in speed for g in names):
        return {g: speed[g] for g in names}
    out = {}
    for g in names:
        c = mw.cluster.group(g)
        peaks = c.gpu.peak_flops
        out[g] = c.num_gpus * peaks.get(mw.precision, max(peaks.values()))
    return out


def _orders(names, rate: dict):
    if len(names) <= 3:
        return list(itertools.permutations(names))
    slow_first = tuple(sorted(names, key=lambda g: rate[g]))
    return [slow_first, tuple(reversed(slow_first))]


def _degrees(mw, order):
    """(dp, per-group tp) with every group's GPUs an exact number of stages of dp x tp."""
    sizes = [mw.cluster.group(g).num_gpus for g in order]
    per_node = [mw.cluster.group(g).gpus_per_node for g in order]
    common = math.gcd(*sizes)
    for dp in (d for d in range(1, common + 1) if common % d == 0):
        options = [[t for t in range(1, n + 1) if n % t == 0 and size % (dp * t) == 0]
                   for n, size in zip(per_node, sizes)]
        for tps in itertools.product(*options):
            yield dp, tps


def _metis_split(blocks: int, rates: list[float], stages: list[int]) -> tuple[int, ...]:
    """Blocks per group in proportion to its speed (largest remainder), each stage at least one block."""
    raw = [blocks * r / sum(rates) for r in rates]
    out = [max(s, int(x)) for s, x in zip(stages, raw)]
    while sum(out) < blocks:
        i = max(range(len(out)), key=lambda i: raw[i] - out[i])
        out[i] += 1
    while sum(out) > blocks:
        i = max((i for i in range(len(out)) if out[i] > stages[i]), key=lambda i: out[i] - raw[i])
        out[i] -= 1
    return tuple(out)


def _splits(blocks: int, stages: tuple[int, ...], metis: tuple[int, ...]):
    """Blocks per group (each stage >= 1 block, summing to `blocks`): all of them when at most MAX_SPLITS,
    else those within NEAR blocks of Metis's split in every group."""
    free = blocks - sum(stages)
    count = math.comb(free + len(stages) - 1, len(stages) - 1)
    # beyond MAX_SPLITS only the window around Metis's split is walked (building every split first took
    # blocks^(groups - 1) steps: hours at 6 groups of 80 blocks)
    ranges = [range(s, blocks + 1) if count <= MAX_SPLITS else range(max(s, m - NEAR), min(blocks, m + NEAR) + 1)
              for s, m in zip(stages[:-1], metis[:-1])]
    for head in itertools.product(*ranges):
        last = blocks - sum(head)
        split = (*head, last)
        if last < stages[-1]:
            continue
        if count > MAX_SPLITS and any(abs(a - b) > NEAR for a, b in zip(split, metis)):
            continue
        yield split


def _price(mw, config, split) -> tuple[float, Lane] | None:
    """(seconds per step, lane) of a configuration at a split, with the leanest recompute that fits."""
    order, dp, tps, stages, mbs = config
    layer_split = tuple(n for g_blocks, s in zip(split, stages) for n in balanced_split(g_blocks, s))
    pp = sum(stages)
    segments = tuple(Segment(g, tp, s) for g, tp, s in zip(order, tps, stages))
    for recompute in ("none", "full"):
        try:
            plan = Plan(dp=dp, tp=tps[0], pp=pp, precision=mw.precision,
                        fp8_recipe=FP8_RECIPES[0] if mw.precision == "fp8" else "none",
                        micro_batch_size=mbs, num_micro_batches=mw.global_batch // (dp * mbs),
                        zero=1 if dp > 1 else 0, recompute=recompute,
                        recompute_blocks=max(layer_split) if recompute == "full" else 0,
                        schedule="1f1b", layer_split=layer_split)
            lane = Lane(segments, plan)
            seconds = lane_time(mw, lane, lane.share)
        except PlanError:
            return None
        if math.isfinite(seconds):
            return seconds, lane
    return None
