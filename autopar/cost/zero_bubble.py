"""Zero-bubble pipeline schedules priced: the bubble left when each backward is split into B (input
gradient) and W (weight gradient), and the activations each keeps in flight.

torch.distributed.pipelining runs three (`autopar.knobs` ZERO_BUBBLE): `zb` is
ScheduleInterleavedZeroBubble (the paper's ZB1P, on v >= 1 chunks per rank), `zbv` is
ScheduleZBVZeroBubble and `dualpipev` ScheduleDualPipeV, both on 2 chunks per rank placed in a V
(`knobs.stage_rank`). Per rank, one micro-batch takes `per_mb` = F + B + W (cost/model.py's
`_per_rank`, host pacing included) of which W is the weight-gradient GEMMs (`weight_seconds`).
1F1B's bubble is the other ranks' micro-batch, sum over r != slowest of per_mb (Narayanan et al.'s
(p - 1)(F + B + W) for even stages), divided by v when interleaved; the zero-bubble schedules leave
less of each rank's micro-batch idle:

* zb: (p - 1)(T_F + T_B - T_W) (Qi et al., Zero Bubble Pipeline Parallelism, ICLR'24, arXiv
  2401.10241, ZB-H1: a third of 1F1B's when T_F = T_B = T_W), i.e. per_mb - 2W per rank, over v
  chunks as interleaving divides it;
* zbv: (p - 1)(T_F + T_B - 2T_W) in chunk times (Qi et al. Section 6, ZB-V: zero when the three are
  equal), i.e. (per_mb - 3W) / 2 per rank (two chunks);
* dualpipev: (PP/2 - 1)(F&B + B - 3W) over PP = 2p chunks with B the whole backward (DeepSeek-V3,
  arXiv 2412.19437 Table 2; deepseek-ai/DualPipe's table for DualPipeV). torch runs the overlapped
  F&B pair one after the other (no overlap callback), so F&B = F + B: (F + 2B_in - W) / 2 per rank,
  i.e. (per_mb + B_in - 2W) / 2.
Each rank's share is floored at 0 (a W larger than F + B fills no more than the bubble).

Memory, in micro-batches of the rank's activations: ZB-H1 keeps 1F1B's peak (Qi et al. Section 2.1:
min(p - r, m) on rank r) plus the W passes it defers, torch's ZB1P by r chunks on rank r
(`_get_1f1b_rank_ops(num_1f1b_microbatches=rank)`), each holding what W reads after B (the weight
GEMMs' inputs: the saved activations less the attention core's, `held` in cost/model.py); ZB-V keeps
p micro-batches on every rank (2p chunks: Qi et al., "the same peak memory as 1F1B", balanced across
workers; torch's ZBV runs each W right after its B until the cool-down); DualPipeV PP + 1 = 2p + 1
chunks, p + 1/2 micro-batches (DeepSeek's table).
"""

from __future__ import annotations

import numpy as np

from autopar.knobs import SCHEDULES

ZB, ZBV, DUALPIPEV = (SCHEDULES.index(s) for s in ("zb", "zbv", "dualpipev"))


def applies(sched: np.ndarray) -> np.ndarray:
    """Which plans (schedule codes) run a zero-bubble schedule."""
    return (sched == ZB) | (sched == ZBV) | (sched == DUALPIPEV)


def weight_share(k: dict[str, np.ndarray]) -> np.ndarray:
    """(K,) the part of each block kind's backward that is W: a linear's weight gradient costs its
    forward's FLOPs (Qi et al. Table 1), and the attention core (scores, softmax, context) has no weights."""
    bwd = k["bwd_flops"]
    w = np.maximum(k["fwd_flops"] - k["attn_core_flops"], 0.0)
    return np.where(bwd > 0, np.minimum(w / np.where(bwd > 0, bwd, 1.0), 1.0), 0.0)


def bubble_share(sched: np.ndarray, per_mb: np.ndarray, weight: np.ndarray, backward: np.ndarray,
                 v: np.ndarray) -> np.ndarray:
    """(G, J): the seconds of each rank's micro-batch the schedule leaves as bubble on the other
    ranks (1F1B: all of per_mb), already divided by the chunks per rank."""
    b_in = np.maximum(backward - weight, 0.0)
    return np.select([sched == ZB, sched == ZBV, sched == DUALPIPEV],
                     [np.maximum(per_mb - 2 * weight, 0.0) / v, np.maximum(per_mb - 3 * weight, 0.0) / 2,
                      np.maximum(per_mb + b_in - 2 * weight, 0.0) / 2], per_mb)


def rank_share(sched: np.ndarray, per_mb: np.ndarray, weight: np.ndarray, backward: np.ndarray,
               v: np.ndarray) -> np.ndarray:
    """(G, J) each rank's share under every schedule, so that the pipe of m micro-batches is, for all of
    them, the sum of the ranks' shares less the slowest rank's, plus m x the slowest rank's micro-batch
    (1F1B, GPipe: per_mb, Narayanan et al.'s sum + (m - 1) x slowest; interleaved: per_mb / v; the
    zero-bubble schedules: `bubble_share`). The per-stage solver (search/stages.py) combines these."""
    return np.where(applies(sched), bubble_share(sched, per_mb, weight, backward, v), per_mb / v)


def share_floor(sched: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kappa, nu) per plan with every rank's share >= (per_mb - kappa x W) / nu: a bound the per-stage
    solver's lower bound uses (W summed over the ranks is the same for every split and recompute)."""
    kappa = np.select([sched == ZB, sched == ZBV, sched == DUALPIPEV], [2.0, 3.0, 2.0], 0.0)
    nu = np.where((sched == ZBV) | (sched == DUALPIPEV), 2.0, v)
    return kappa, nu


def pipe(sched: np.ndarray, per_mb: np.ndarray, mult: np.ndarray, weight: np.ndarray, backward: np.ndarray,
         m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(G,) the pipeline of m micro-batches under a zero-bubble schedule: m x the slowest rank plus the
    other ranks' bubble shares (`bubble_share`)."""
    share = bubble_share(sched, per_mb, weight, backward, v)
    slowest = np.argmax(per_mb, axis=1)[:, None]
    others = (share * mult).sum(axis=1) - np.take_along_axis(share, slowest, axis=1)[:, 0]
    return others + m[:, 0] * per_mb.max(axis=1)


def worst_in_flight(sched: np.ndarray, pp: np.ndarray, m: np.ndarray, v: np.ndarray, first: np.ndarray,
                    last: np.ndarray, act: np.ndarray, held: np.ndarray) -> np.ndarray:
    """(G, J) the most bytes of act x kept(r) + held x deferred(r) (`in_flight`) over the ranks r of each
    class of alike ranks, [first, last]: under zb the deferred W passes grow with the rank while the kept
    micro-batches fall, so the class's lowest rank is not always its worst (with recompute, which shrinks
    what is kept but not what W reads, the highest often is). Both counts are linear in r between their
    breaks (kept: where m stops binding; deferred: r = m v), so the maximum over integer ranks lies at an
    end of the class or at an integer next to a break."""
    warm = np.where(v > 1, pp - 1 - (m * v - (v - 1) * pp - 1) / 2, pp - m)
    candidates = [first, last]
    for brk in (warm, m * v):
        candidates += [np.clip(np.floor(brk), first, last), np.clip(np.ceil(brk), first, last)]
    worst = None
    for r in candidates:
        kept, deferred = in_flight(sched, pp, m, v, r)
        bytes_ = act * kept + held * deferred
        worst = bytes_ if worst is None else np.maximum(worst, bytes_)
    return worst


def in_flight(sched: np.ndarray, pp: np.ndarray, m: np.ndarray, v: np.ndarray, rank: np.ndarray):
    """(G, J) micro-batches of activations each rank keeps at its peak, and (G, J) deferred W passes'
    worth of `held` bytes, under the zero-bubble schedules (0 elsewhere)."""
    chunks = np.minimum((pp - rank - 1) * 2 + (v - 1) * pp + 1, m * v)  # interleaved 1F1B's warm-up
    zb = np.where(v > 1, chunks / v, np.minimum(pp - rank, m))
    kept = np.select([sched == ZB, sched == ZBV, sched == DUALPIPEV],
                     [zb, np.minimum(pp, m), np.minimum(pp + 0.5, m)], 0.0)
    deferred = np.where(sched == ZB, np.minimum(rank, m * v) / v, 0.0)
    return kept, deferred
