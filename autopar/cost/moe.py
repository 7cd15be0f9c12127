"""Mixture-of-experts terms of the cost model: expert parallelism's all-to-all, the grouped GEMMs of
the routed experts, their parameters over the expert-parallel and expert-data-parallel groups.

What the core model (`cost/model.py`) gets from here, per plan and block kind:

- The routed experts are taken out of the profile's layer figures (the profiler counts them
  force-balanced: every expert sees tokens x top_k / experts) and priced here on the slowest
  expert-parallel rank: tokens per local expert = tokens x top_k x ep / experts x imbalance, the
  three SwiGLU GEMMs (forward M x N x K = tokens x ffn x hidden, and the two backward GEMMs) as the
  runtime launches them: one grouped GEMM, its tile quantisation per expert and its wave quantisation
  over all local experts, or Megatron-Core's per-expert loop, whose waves 4 experts share at a time
  (`expert_gemm_efficiency`, `per_expert_loop`; the tile/wave model of `cost/gemm.py`); the loop's host
  launches (at the GPU's `Coefficients.launch_s`) pace the experts where they outlast the GPU and the
  dropless dispatcher's host sync keeps them from running ahead (`dispatcher_syncs`), and a
  grouped kernel pays `MoeFit.problem_s` a problem (fitted to the published MoE rows inside a public
  bound). A capacity
  factor caps the busiest expert's tokens, and padding to it (`moe_pad_to_capacity`) fills every expert
  (`imbalance`). The
  permutation of the routed tokens stays in the layer's elementwise traffic as profiled (eager torch),
  unless DeepEP's dispatcher replaces it by Transformer Engine's fused permute (`fused_permute`) or
  Megatron-Core's alltoall dispatcher by its fused permute and expert sort (`alltoall_permute`;
  `dispatch_as_run` takes the eager passes out).
- Dispatch and combine: one all-to-all each per MoE layer in forward, and again in backward (the
  backward of a dispatch is a combine and the reverse), of tokens x top_k x hidden 16-bit values
  per rank (`all_to_all_time`); under DeepEP one copy per destination rank and node (`destinations`:
  exact for the benchmarks' balanced gate, `consecutive_span`). Nothing hides them: torch's executor
  (and torchtitan, AutoModel without DeepEP's async mode, Megatron-Core without `--overlap-moe-expert-parallel-comm`) waits
  for each before the experts run, so they sit on the critical path; the
  `moe_a2a_overlap` runtime switch models Megatron-Core's 1F1B A2A overlap (one micro-batch's
  all-to-all under another's compute) as hiding what the layer's compute can cover.
- The expert parameters live 1/ep on each rank; their gradients reduce over the expert-data-
  parallel group (dp x cp / ep ranks, `data_parallel_terms`), their optimizer states shard over it;
  the dispatch buffers (the routed tokens in expert order and the experts' output) are memory of
  their own.

The group's links come from the cluster graph: ep ranks are the innermost of the data-parallel
ranks (`autopar.axes.FoldedAxis`), so an ep group of n ranks spaced `stride` apart has
`per_node` of them on each node; an all-to-all sends (per_node - 1)/n of each rank's bytes over
NVLink and (n - per_node)/n over the node's NICs, at the same time.

nccl-tests' all-to-all convention (docs/references.md §3): busbw = algbw x (n - 1)/n, so the time of
an all-to-all of S bytes per rank is S (n - 1)/n / busbw; we take busbw as the link's efficiency
times its datasheet rate, as for every other collective of the cost model (no all-to-all curve is
measured yet: `autopar profile-cluster` times all-reduce, reduce-scatter, all-gather, broadcast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar import axes
from autopar.cost import precision as fp8
from autopar.cost.arrays import mesh_order_of, unique_rows
from autopar.cost.collectives import all_gather_time, all_reduce_time, all_to_all_time
from autopar.cost.gemm import TILES
from autopar.runtime import is_megatron


@dataclass(frozen=True)
class MoeKind:
    """One block kind's routed experts (the profile's MoE fields): `experts` SwiGLU FFNs of
    `ffn` x `hidden`, `top_k` per token, `params` of them all, `flops` forward per sample
    (force-balanced)."""

    experts: int
    top_k: int
    hidden: int
    ffn: int
    params: float
    flops: float


def moe_kinds(profile) -> list[MoeKind | None]:
    """Per block kind of the profile (embed, layer kinds, head): its routed experts, or None."""
    hidden = int(profile.dims.get("hidden", 0))
    return [MoeKind(b.experts, b.top_k, hidden, b.expert_ffn, float(b.expert_params), float(b.expert_flops))
            if getattr(b, "experts", 0) else None for b in profile.blocks]


def expert_kind_arrays(profile) -> dict[str, np.ndarray]:
    """Per block kind (K,): the routed experts' share of the profile's figures (per sample, balanced),
    which the core model removes from the dense pricing: params, forward and backward FLOPs."""
    kinds = moe_kinds(profile)
    params = np.array([k.params if k else 0.0 for k in kinds])
    fwd = np.array([k.flops if k else 0.0 for k in kinds])
    return {"expert_params": params, "expert_fwd_flops": fwd, "expert_bwd_flops": 2.0 * fwd}


# A dropless MoE written in eager torch (autopar/zoo/moe.py, torchtitan's MoE alike) passes over the
# routed tokens (seq x top_k x hidden values, the profile's `dispatch_bytes` a sample) ten times in HBM
# per forward: the gather into expert order (read + write), the concatenation of the experts' outputs
# (2), the zero-filled buffer (1), the scatter back to token order (2), the routing weights' product (2)
# and the sum over top_k (1 + 1/k, taken as 1). Megatron-Core's DeepEP dispatcher (the `deepep` switch;
# NeMo AutoModel runs the same code) replaces them by Transformer Engine's fused permute and unpermute
# on the experts' rank (`fused_permute`), around DeepEP's dispatch and combine, which move whole tokens.
EAGER_PERMUTE_PASSES = 10.0


def dispatch_as_run(k: dict[str, np.ndarray], workload) -> dict[str, np.ndarray]:
    """The per-kind figures with the eager permutation passes taken out of the elementwise traffic where
    the runtime's dispatcher replaces them by fused kernels (the `deepep` switch, priced per plan by
    `fused_permute`; Megatron-Core's alltoall dispatcher with permute fusion, `alltoall_permute`); as
    profiled otherwise (eager torch)."""
    if "deepep" not in workload.switches and not is_megatron(workload.runtime):
        return k
    routed = np.array([float(getattr(b, "dispatch_bytes", 0.0)) for b in workload.profile.blocks])
    return {**k, "io_bytes": np.maximum(k["io_bytes"] - EAGER_PERMUTE_PASSES * routed, 0.0)}


def fused_permute(token_bytes, top_k: int, ranks, hbm_bytes_per_s: float):
    """Seconds of the fused permute and unpermute (Transformer Engine's `moe_permute` / `moe_unpermute`,
    which Megatron-Core's DeepEP dispatcher runs with permute fusion on, as NeMo AutoModel sets it) for one
    MoE layer's forward on the busiest rank: DeepEP delivers each token once per destination rank
    (`ranks` copies of the `token_bytes` a rank routes); the permute reads them and writes one copy per
    local expert (top_k copies in all), the unpermute reads those copies and writes the tokens back.
    The backward runs the same two kernels the other way round: the same bytes."""
    return 2.0 * token_bytes * (top_k + ranks) / hbm_bytes_per_s


def alltoall_permute(token_bytes, top_k: int, ep, hbm_bytes_per_s: float):
    """Seconds of Megatron-Core's alltoall dispatcher's permutations (`MoEAlltoAllTokenDispatcher`,
    `moe_permute_fusion`, as Megatron-Bridge's Qwen3 and GPT-OSS providers set it) for one MoE layer's
    forward on the busiest rank: TE's fused permute on the sending rank reads the rank's tokens and
    writes top_k copies in expert order, and under ep > 1 `sort_chunks_by_idxs` reorders the received
    copies from (source rank, expert) to (expert, source rank), a read and a write of the top_k copies;
    the combine runs both the other way. Backward: the same bytes."""
    sort = np.where(np.asarray(ep) > 1, 2.0 * top_k, 0.0)
    return 2.0 * token_bytes * (1.0 + top_k + sort) / hbm_bytes_per_s


def per_expert_loop(workload) -> bool:
    """Whether the runtime runs a layer's experts as one GEMM launch per local expert: Megatron-Core's
    `TEGroupedMLP` (Transformer Engine's `GroupedLinear`, whose grouped GEMM is a loop of cuBLAS calls
    over the local experts spread over `TE_STREAMS` streams, `general_grouped_gemm`) does; autopar's
    executor (`torch._grouped_mm`) and NeMo AutoModel's DeepEP experts (`grouped_gemm.ops.gmm`) run the
    local experts as one grouped problem."""
    return is_megatron(workload.runtime)


# Transformer Engine's multi-stream cuBLAS grouped GEMM (TE PR #853, "Grouped GEMM via multi-stream
# cuBLAS"): the per-expert GEMMs go round-robin over its compute streams (4:
# transformer_engine/common/util/multi_stream.cpp, get_num_compute_streams), so at most 4 experts' tiles
# share the GPU's waves at a time.
TE_STREAMS = 4


def expert_gemm_efficiency(per_expert, kind: MoeKind, local, sms: int, c, loop: bool):
    """Fraction of the bf16 peak the rank's expert GEMMs reach: the GPU's GEMM efficiency, the size curve
    (`gemm_half_flops`) at the rank's expert FLOPs, and the tile/wave shape (`grouped_efficiency`) as the
    runtime launches the experts: one grouped problem whose tiles share the waves, or under a per-expert
    loop at most `TE_STREAMS` experts' tiles at a time (a 4096 x 1536 expert GEMM fills 192 tiles, two
    waves of 132 SMs at 73%)."""
    flops = 2.0 * 3.0 * per_expert * local * kind.ffn * kind.hidden  # forward, the three SwiGLU GEMMs
    shape = grouped_efficiency(per_expert, kind.ffn, kind.hidden, local, sms, TE_STREAMS if loop else None)
    return np.maximum(c.gemm_efficiency * shape * flops / (flops + c.gemm_half_flops * shape), 1e-9)


def distinct(top_k: int, bins):
    """Expected distinct bins (ranks, nodes) a token's top_k experts fall in, drawn uniformly over
    `bins` bins: bins x (1 - (1 - 1/bins)^top_k)."""
    bins = np.maximum(np.asarray(bins, dtype=float), 1.0)
    return bins * (1.0 - (1.0 - 1.0 / bins) ** top_k)


def consecutive_span(top_k: int, experts: int, per_bin) -> np.ndarray:
    """Expected distinct bins (ranks, nodes: `per_bin` consecutive experts each) a token's experts fall in
    under the balanced gate, which gives the token at index i experts i·k ... i·k + k − 1 (mod experts):
    the mean over one period of starting experts (experts / gcd(experts, k) tokens)."""
    per_bin = np.asarray(per_bin, dtype=float)
    period = experts // math.gcd(experts, top_k)
    picks = (np.arange(period)[:, None] * top_k + np.arange(top_k)) % experts  # (period, k) expert indices
    out = np.ones(per_bin.shape)
    for width in np.unique(per_bin):
        bins = np.sort(picks // max(int(width), 1), axis=1)
        out[per_bin == width] = 1.0 + (np.diff(bins, axis=1) > 0).sum(1).mean()
    return out


def destinations(kind: MoeKind, ep, per_node, profile) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, nodes) a token's copies reach under DeepEP, which sends it once per destination rank and
    across the fabric once per destination node: exact for the balanced gate (consecutive experts, the
    published benchmarks' gate); for a learned gate the expectation for uniformly drawn experts, capped
    by the model's node limit."""
    local = kind.experts / ep  # experts per rank
    if profile.gate == "balanced":
        return (consecutive_span(kind.top_k, kind.experts, local),
                consecutive_span(kind.top_k, kind.experts, local * per_node))
    limit = profile.node_limit or np.inf
    return (distinct(kind.top_k, np.minimum(ep, per_node * limit)),
            np.minimum(distinct(kind.top_k, ep / per_node), limit))


# -- the grouped GEMM -------------------------------------------------------------------------------
def grouped_efficiency(m: np.ndarray, n: float, k: float, groups: np.ndarray, sms: int,
                       concurrent: int | None = None) -> np.ndarray:
    """Useful fraction of the tile-waves of a grouped GEMM of `groups` problems, each m x n (x k):
    each problem pays whole tiles (tile quantisation, per expert: few tokens per expert waste most of
    a 128-row tile), the tiles of all problems share the waves (wave quantisation, per launch), or of
    `concurrent` problems at a time where the runtime launches them apart (a per-expert loop).
    Forward (m x n), activation gradient (m x k) and weight gradient (n x k, reducing over m) are
    weighted by their equal FLOPs (harmonic mean, as `cost/gemm.py` does for a layer)."""
    m = np.maximum(np.asarray(m, dtype=float), 1.0)
    groups = np.asarray(groups, dtype=float)
    if not sms:
        return np.ones(np.broadcast(m, groups).shape)

    share = groups if concurrent is None else np.minimum(groups, concurrent)  # problems sharing the waves
    one = lambda rows, cols: wave_efficiency(rows, cols, share, sms)  # noqa: E731
    return 3.0 / (1.0 / one(m, n) + 1.0 / one(m, k) + 1.0 / one(n, k))


def wave_efficiency(rows, cols, share, sms: int) -> np.ndarray:
    """Useful fraction of the tile-waves of `share` rows x cols outputs launched together, best tile."""
    share = np.asarray(share, dtype=float)
    best = np.zeros(np.broadcast(rows, cols, share).shape)
    for tm, tn in TILES:
        tiles = share * np.ceil(rows / tm) * np.ceil(cols / tn)
        best = np.maximum(best, share * rows * cols / (tm * tn) / (np.ceil(tiles / sms) * sms))
    return best


# -- the all-to-all ---------------------------------------------------------------------------------
def ep_links(cluster, ep: int, stride: int, coeffs) -> tuple[float, float, float, int]:
    """(NVLink bytes/s, NIC bytes/s, latency, ranks per node) of an ep group of `ep` ranks `stride`
    apart, efficiencies applied. Inside a node: the group's ring on the cluster graph. Across nodes
    the all-to-all is not a ring: every rank sends its own off-node share through the node's NICs,
    which the group's ranks on that node share (at most one NIC each: rail-optimised fabrics keep a
    GPU on its own rail)."""
    if ep <= 1:
        return np.inf, np.inf, 0.0, 1
    gpn = cluster.gpus_per_node
    per_node = max(1, min(ep, gpn // stride)) if stride < gpn else 1
    intra = cluster.ring(per_node, stride) if per_node > 1 else None
    intra_bw = intra.bandwidth * coeffs.link(intra.kind) if intra is not None else np.inf
    if per_node >= ep:  # inside one node
        return intra_bw, np.inf, intra.latency * coeffs.latency_scale, per_node
    whole = cluster.ring(ep, stride)
    nic = cluster.links[cluster.node.nic_kind]
    inter_bw = nic.bandwidth * min(1.0, cluster.node.nics / per_node) * coeffs.link(nic.kind)
    return intra_bw, inter_bw, whole.latency * coeffs.latency_scale, per_node


# -- per plan ---------------------------------------------------------------------------------------
def _ep(pa) -> np.ndarray:
    """The plans' expert-parallel degrees."""
    return np.asarray(pa.ep, dtype=int)


def _group_links(workload, pa, coeffs) -> dict[str, np.ndarray]:
    """Per plan: the ep group's NVLink and NIC rates, latency and ranks per node, and the expert-data-
    parallel group's degree (the ranks ep splits, dp x cp, over ep) and ring (ep x the ep stride
    apart), once per distinct layout."""
    names = tuple(axes.AXES)
    folded = axes.FOLDED["ep"]
    ep = _ep(pa)
    first, inverse = unique_rows([getattr(pa, a) for a in names] + [pa.mesh_order, ep])
    table = np.zeros((len(first), 7))
    cluster = workload.cluster
    for row, i in enumerate(first):
        dims = axes.ParallelDims({a: int(getattr(pa, a)[i]) for a in names}, mesh_order_of(pa.mesh_order[i]))
        stride, e = folded.stride(dims), int(ep[i])
        table[row, :4] = ep_links(cluster, e, stride, coeffs)
        edp = folded.whole(dims.degrees) // e
        table[row, 6] = edp
        if edp > 1:
            ring = cluster.ring(edp, stride * e)
            table[row, 4:6] = (ring.bandwidth * coeffs.link(ring.kind), ring.latency * coeffs.latency_scale)
        else:
            table[row, 4:6] = (np.inf, 0.0)
    t = table[inverse.reshape(-1)]
    return {"intra_bw": t[:, 0], "inter_bw": t[:, 1], "lat": t[:, 2], "per_node": t[:, 3],
            "edp_bw": t[:, 4], "edp_lat": t[:, 5], "edp": t[:, 6]}


def imbalance(workload) -> float:
    """Tokens each expert of the busiest expert-parallel rank computes over the balanced share: the
    workload's imbalance (1.0: force-balanced), capped by the model's capacity factor where it has one
    (an expert takes at most that multiple of its balanced share and drops the rest before the dispatch;
    0: dropless, no cap). Under `moe_pad_to_capacity` (Megatron-Core's
    `--moe-pad-expert-input-to-capacity`) every expert computes and receives exactly its capacity, the
    tokens it lacks as zero padding: the capacity factor whatever the routing."""
    skew = workload.expert_imbalance
    capacity = workload.profile.capacity_factor
    if capacity <= 0:
        return skew
    return capacity if PAD_SWITCH in workload.switches else min(skew, max(capacity, 1.0))


# The fixed cost per expert problem the tile/wave model does not see in a grouped kernel, fitted to the
# published MoE rows only (experiments/fit_moe.py, leave-one-row-out) inside a bound set by a public
# microbenchmark:
@dataclass(frozen=True)
class MoeFit:
    """`problem_s`: seconds per expert GEMM problem inside one grouped kernel (its per-group scheduling and
    the tail of a few-token problem): tgale96/grouped_gemm PR #37's H100 CUTLASS grouped kernels run
    Qwen3-30B-A3B's up_proj (128 experts of 512 tokens) at 160.5 TFLOP/s where the tile/wave model gives
    600-700, at most 15 us a problem if all of that gap were per problem. Not under the per-expert loop,
    whose launches the same benchmark's cuBLAS loop already matches (`tests/test_moe_fine_grained.py`) and
    whose host time is the GPU's launch cost (`Coefficients.launch_s`, `expert_section`)."""

    problem_s: float = 0.0


FIT_BOUNDS = {"problem_s": (0.0, 15e-6)}
FIT = MoeFit(problem_s=0.0)  # experiments/fit_moe.py over all six rows (docs/moe-cost.md)
PAD_SWITCH = "moe_pad_to_capacity"

# Kernels the per-expert loop launches per local expert and layer (`TEGroupedLinear`: fc1 with gate and up
# fused, fc2; the activation runs once over all experts): forward the two GEMMs, backward the four
# (activation and weight gradients); under TE's fp8 current scaling each GEMM input (forward) and output
# gradient (backward) is quantized per expert by three kernels (amax, scale from amax, cast).
LOOP_GEMMS = (2, 4)
TE_QUANTIZE_LAUNCHES = 3


def loop_launches(te_fp8) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) kernels the per-expert loop launches per local expert, per plan."""
    te_fp8 = np.asarray(te_fp8, dtype=float)
    return (LOOP_GEMMS[0] + 2 * TE_QUANTIZE_LAUNCHES * te_fp8, LOOP_GEMMS[1] + 2 * TE_QUANTIZE_LAUNCHES * te_fp8)


def dispatcher_syncs(workload) -> bool:
    """Whether the dispatcher copies the tokens per expert to the host every MoE layer: Megatron-Core's
    dropless alltoall dispatcher does (its all-to-all's splits and the loop's `m_splits` are host lists:
    `MoEAlltoAllTokenDispatcher.preprocess`, cuda_sync_point "before_ep_alltoall"); padded to a capacity
    (`moe_pad_to_capacity` with the model's capacity factor) every split is the capacity, known on the
    host ("no_sync"), so the loop's launches run ahead of the GPU, hidden like the layer's other launches
    (which `cost/launches.py` leaves out for a MoE model)."""
    return not (PAD_SWITCH in workload.switches and workload.profile.capacity_factor > 0)


def expert_section(gpu_s, local, launches, loop: bool, launch_s: float, fit: MoeFit, synced: bool = True):
    """Seconds of one pass of a rank's experts. Under the per-expert loop, where the dispatcher syncs
    (`dispatcher_syncs`), the longer of the GPU's time and the host's launches at `launch_s` each (the GPU's
    launch cost, `Coefficients.launch_s`): the copy of the tokens per expert to the CPU before the experts
    run drains the GPU's queue every MoE layer, so nothing launched earlier hides the loop's launches;
    without the sync, the GPU's time. One grouped kernel pays `problem_s` per expert GEMM problem
    (`launches`: its GEMMs per expert)."""
    if loop:
        return np.maximum(gpu_s, launch_s * local * launches) if synced else gpu_s
    return gpu_s + fit.problem_s * local * launches


def pipeline_terms(workload, g, c, micro_batch, sp_div, act_bytes, peak) -> dict[str, np.ndarray]:
    """Per plan and block kind (G, K), one micro-batch on the slowest expert-parallel rank: the
    routed experts' forward and backward GEMM seconds, the dispatch + combine all-to-all seconds of
    forward and of backward (what an overlap switch leaves exposed), and the expert parameters a
    rank holds. Arguments are (G, 1) columns of the core model's `_pipeline`."""
    profile, cluster = workload.profile, workload.cluster
    fit = FIT  # read at each call: experiments/fit_moe.py evaluates other values
    kinds = moe_kinds(profile)
    zeros = np.zeros((len(g), len(kinds)))
    if not any(kinds):
        return {"expert_f": zeros, "expert_b": zeros, "a2a_f": zeros, "a2a_b": zeros, "expert_params": zeros}
    ep = _ep(g)[:, None].astype(float)
    links = _group_links(workload, g, c)
    col = lambda a: np.asarray(a, dtype=float)[:, None]  # noqa: E731
    tokens = micro_batch * profile.seq_len / sp_div  # tokens a rank routes per micro-batch
    skew = imbalance(workload)
    deepep = "deepep" in workload.switches
    hbm = cluster.gpu.hbm_bytes_per_s * c.hbm_efficiency
    # fp8 plans under Megatron-Core run the experts as Transformer Engine's grouped linear in fp8: the
    # fp8 GEMM rate, and a cast of each GEMM input (forward) and output gradient (backward; gate and up
    # are one GEMM of 2 x ffn). torchao's float8 conversion, which autopar's executor applies, swaps
    # nn.Linear modules only: the zoo's stacked experts stay bf16 under the torch runtime.
    te_fp8 = ((np.asarray(g.precision) == fp8.FP8) & is_megatron(workload.runtime))[:, None].astype(float)
    loop = per_expert_loop(workload)
    plain = not deepep and is_megatron(workload.runtime)  # Megatron-Core's alltoall dispatcher
    launches_f, launches_b = loop_launches(te_fp8)
    synced = dispatcher_syncs(workload)
    out = {name: zeros.copy() for name in ("expert_f", "expert_b", "a2a_f", "a2a_b", "expert_params")}
    for j, kind in enumerate(kinds):
        if kind is None:
            continue
        local = kind.experts / ep  # experts per rank
        per_expert = tokens * kind.top_k * skew / local  # tokens of the busiest rank's experts
        flops = kind.flops * tokens / profile.seq_len * skew
        rate = peak * expert_gemm_efficiency(per_expert, kind, local, cluster.gpu.sms, c, loop)
        gemm = flops / rate * np.where(te_fp8, fp8.fp8_time_factor(flops, c, cluster.gpu), 1.0)
        rows = tokens * kind.top_k * skew  # the routed copies the busiest rank's experts take
        cast = te_fp8 * fp8.TE_CAST_BYTES * rows / hbm  # seconds per element of a cast tensor's row
        gpu_f, gpu_b = gemm + cast * (kind.hidden + kind.ffn), 2 * gemm + cast * (2 * kind.ffn + kind.hidden)
        out["expert_f"][:, j] = expert_section(gpu_f, local, launches_f if loop else LOOP_GEMMS[0], loop,
                                               c.launch_s, fit, synced)[:, 0]
        out["expert_b"][:, j] = expert_section(gpu_b, local, launches_b if loop else LOOP_GEMMS[1], loop,
                                               c.launch_s, fit, synced)[:, 0]
        token_bytes = tokens * kind.hidden * act_bytes * skew  # one copy of the rank's tokens
        per_node = col(links["per_node"])
        on_node = off_node = None
        if deepep:  # one copy per destination rank, and across the fabric one per destination node
            nodes = ep / per_node
            ranks, node_copies = destinations(kind, ep, per_node, profile)
            on_node = token_bytes * ranks * (ep - 1) / ep  # every remote copy crosses NVLink once
            off_node = token_bytes * node_copies * (nodes - 1) / nodes
            permute = fused_permute(token_bytes, kind.top_k, ranks, hbm)
            out["expert_f"][:, j] += permute[:, 0]
            out["expert_b"][:, j] += permute[:, 0]
        elif plain:  # TE's fused permute on the sending rank and the expert-order sort after the all-to-all
            permute = alltoall_permute(token_bytes, kind.top_k, ep, hbm)
            out["expert_f"][:, j] += permute[:, 0]
            out["expert_b"][:, j] += permute[:, 0]
        one = all_to_all_time(token_bytes * kind.top_k, ep, per_node, col(links["intra_bw"]), col(links["inter_bw"]),
                              col(links["lat"]), c.collective_latency_s, on_node, off_node)
        out["a2a_f"][:, j] = out["a2a_b"][:, j] = (2 * one)[:, 0]  # dispatch + combine
        out["expert_params"][:, j] = (kind.params / ep)[:, 0]
    if "moe_a2a_overlap" in workload.switches:  # another micro-batch's compute covers the all-to-all
        for p, comp in (("a2a_f", "expert_f"), ("a2a_b", "expert_b")):
            out[p] = np.maximum(out[p] - out[comp], 0.0)
    return out


MEMORY_PARTS = ("expert_weights", "expert_optimizer", "dispatch_buffers")


def data_parallel_terms(workload, pa, c, expert_local, zero, nmb, accumulate, prec_bytes, grad_bytes, fp32,
                        offload, micro_batch, sp_div) -> dict[str, np.ndarray]:
    """Per plan and representative pipeline rank (N, J): the expert gradients' collectives over the
    expert-data-parallel group (`edp_s`: all-reduce under DDP / ZeRO-1; reduce-scatter under ZeRO-2
    and 3, which also all-gathers the experts for every forward and backward unless the pipeline
    accumulates them), the expert parameters whose optimizer step this rank runs (`opt_params`), and
    memory by component: expert weights and gradients (1/ep of the experts, sharded over edp by
    ZeRO-3 / ZeRO-2), their fp32 master weights and Adam moments (sharded over edp from ZeRO-1), and
    one MoE layer's routed tokens in expert order and the experts' output before the combine (the
    dispatch buffers; ep 1 permutes locally into the same pair). Arguments are the core model's (N, 1)
    columns (`grad_bytes`: bytes per gradient element); `expert_local` is (N, J)."""
    kinds = [k for k in moe_kinds(workload.profile) if k is not None]
    out = {name: np.zeros_like(expert_local) for name in ("edp_s", "opt_params", *MEMORY_PARTS)}
    if not kinds:
        return out
    links = _group_links(workload, pa, c)
    edp = links["edp"][:, None]
    bw, lat = links["edp_bw"][:, None], links["edp_lat"][:, None]
    base = c.collective_latency_s
    grads = expert_local * grad_bytes
    params = expert_local * prec_bytes
    scatter = all_gather_time(grads, edp, bw * c.collective("reduce_scatter"), lat, base)
    gather = all_gather_time(params, edp, bw * c.collective("all_gather"), lat, base)
    sync = np.select([zero <= 1, zero == 2], [all_reduce_time(grads, edp, bw, lat, base), scatter],
                     scatter + np.where(accumulate, 1.0, 2 * nmb) * gather)
    out["edp_s"] = np.where(edp > 1, sync, 0.0)
    shard_states = np.where(zero >= 1, edp, 1.0)
    out["opt_params"] = expert_local / shard_states
    unsharded = accumulate & (zero >= 2)
    out["expert_weights"] = (params / np.where((zero == 3) & ~unsharded, edp, 1.0)
                             + params / np.where((zero >= 2) & ~unsharded, edp, 1.0))
    out["expert_optimizer"] = np.where(offload, 0.0, expert_local * (np.where(fp32, 0.0, 4.0) + 8.0) / shard_states)
    tokens = micro_batch * workload.profile.seq_len / sp_div
    widest = max(k.top_k * k.hidden for k in kinds)
    # the routed tokens in expert order and the experts' output before the combine: one layer's pair,
    # with or without an all-to-all (ep 1 permutes locally), the busiest rank's share under ep
    skew = np.where(_ep(pa)[:, None] > 1, imbalance(workload), 1.0)
    out["dispatch_buffers"] = 2 * tokens * widest * prec_bytes * skew * np.ones_like(expert_local)
    return out
