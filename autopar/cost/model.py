"""The analytic cost model, vectorised over plans.

Time follows Megatron-LM's accounting (Narayanan et al. SC'21; Korthikanti et al. 2022): per
micro-batch, each pipeline rank runs forward, backward and any recompute of its blocks, with
tensor-parallel collectives on the critical path (each pass's own: cost/tensor_parallel.py); a
pipeline of m micro-batches takes sum over ranks + (m - 1) x the slowest rank (the (p - 1)/m bubble
for even stages, (p - 1)/(v m) interleaved; the zero-bubble schedules' smaller bubble and their own
activations in flight: cost/zero_bubble.py); data-parallel gradient reduction runs in buckets under
the last backward and only its excess is exposed (a tied embedding split over the pipeline adds its
exposed all-reduce between the two ends); the optimizer step is memory-bound. Small runs add fixed
costs the big ones hide: each collective call's base latency (`collective_latency_s`), and the
host's kernel launches (`block_host_s` per layer per pass, each other block in layers' worth of the
kernels it launches (cost/launches.py), plus `tp_host_s` for DTensor's dispatch under tensor
parallelism and `selective_host_s` for PyTorch's selective checkpoint), which the GPU
hides only while it has more work queued than the host takes to launch it: a micro-batch on a rank
takes the `host_overlap`-norm of its GPU time and its host time (the excess is reported as
"overhead"). ZeRO's collectives follow what the executor runs (FSDP2, ZeroRedundancyOptimizer,
torch.distributed.pipelining), at their measured `collective_efficiency`. Memory is the exact sum of
weights, gradients, master weights and Adam moments by ZeRO stage, the activations the schedule
keeps in flight on each rank (from the profiled saved bytes), communication buffers and a workspace.

The workload's runtime (autopar/runtime.py) decides what overlaps: under ``torch`` the attention
runs as the model file writes it and DDP / FSDP hide `dp_overlap` of backward's time; under
``megatron`` attention is Megatron's own whatever the file writes (its unfused softmax priced from
the score count, or with `flash_attn` a flash kernel whose backward recomputes the scores), the
pipeline's boundary activations travel scattered over the tensor-parallel ranks, and each overlap
switch the workload turns on hides its collective as Megatron-Core schedules it. Megatron's eager
paths are priced where they run: its torch softmax where the fused kernel cannot
(cost/softmax_fallback.py), its fp32 vocabulary-parallel loss under a switch (cost/cross_entropy.py),
its padded vocabulary as weights and GEMM work (cost/vocabulary.py). What each overlap hid is
returned as `hidden_tp_comm` and `hidden_dp_comm`.

Shapes: N plans; K block kinds of the profile (embed, layer kinds, head); J representative
pipeline ranks per plan (see SplitTable). Everything is seconds and bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from autopar import axes
from autopar.cost.arrays import PlanArrays, mesh_order_of, unique_rows
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import all_gather_time, all_reduce_time
from autopar.cost import moe
from autopar.cost import cross_entropy, launches, op_sac, softmax_fallback, tensor_parallel, vocabulary
from autopar.cost import precision as fp8
from autopar.cost.fused import megatron_layer_io, megatron_layer_saved
from autopar.cost.context_parallel import gradient_group_size, sequence_share
from autopar.cost import hsdp
from autopar.cost import zero_bubble
from autopar.cost.gemm import kind_efficiency
from autopar.runtime import is_megatron, megatron_attention
from autopar.knobs import COMM_DTYPES, DTYPE_BYTES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, knobs, storage_dtype

PRECISION_BYTES = np.array([DTYPE_BYTES[p] for p in PRECISIONS], dtype=float)
COMM_BYTES = np.array([DTYPE_BYTES[p] for p in COMM_DTYPES], dtype=float)
# what Megatron's fused softmax takes
SIXTEEN_BIT = np.array([storage_dtype(p) in ("bf16", "fp16") for p in PRECISIONS])
SELECTIVE, FULL = RECOMPUTE_MODES.index("selective"), RECOMPUTE_MODES.index("full")
GPIPE, INTERLEAVED = SCHEDULES.index("gpipe"), SCHEDULES.index("interleaved")
LAYER_FLOORS = ("kind_layers", "kind_params", "kind_expert_params", "kind_activations", "kind_least_activations",
                "kind_seconds", "kind_rate", "kind_rate2", "kind_intercept", "kind_full_rate", "kind_held",
                "first_seconds", "last_seconds", "rank_p2p")  # `_layer_floors`' figures: evaluate(..., ranks=True)

HIDDEN_PARTS = ("hidden_tp_comm", "hidden_dp_comm")  # seconds of communication an overlap hid
TIME_PARTS = ("compute", "recompute", "tp_comm", "ep_comm", "pp_p2p", "pp_bubble", "dp_comm", "optimizer", "overhead")
MEMORY_PARTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations",
                "comm_buffers", "workspace") + moe.MEMORY_PARTS


def time_parts() -> tuple[str, ...]:
    """TIME_PARTS and the time terms of declared axes and knobs: the breakdown of an estimate."""
    return TIME_PARTS + tuple(k.name for k in knobs() if k.time_term is not None)


def memory_parts() -> tuple[str, ...]:
    return MEMORY_PARTS + tuple(f"{k.name}_memory" for k in knobs() if k.memory_term is not None)


def _kind_arrays(profile) -> dict[str, np.ndarray]:
    names = ("params", "tp_params", "fwd_flops", "bwd_flops", "tp_fwd_flops", "saved_bytes", "saved_tp_bytes",
             "attn_core_bytes", "attn_core_flops", "io_bytes", "out_bytes", "tp_comm_bytes", "attn_flops",
             "attn_core_io_bytes", "attn_scores", "tp_gather_bytes", "loss_saved_bytes", "loss_saved_tp_bytes",
             "entry_saved_bytes", "launches", "loss_launches")
    out = {n: np.array([float(getattr(b, n)) for b in profile.blocks]) for n in names}
    out["is_layer"] = np.array([0.0] + [1.0] * len(profile.layers) + [0.0])
    experts = moe.expert_kind_arrays(profile)  # the routed experts are priced by cost/moe.py
    for name in ("params", "fwd_flops", "bwd_flops"):
        out[name] = out[name] - experts[f"expert_{name}"]
    return out


# Megatron's unfused attention, per score element in 16-bit: q·kᵀ writes the scores (2 bytes: with
# K = head size the batched matmuls are bound by this traffic, not by FLOPs), the fused
# scale-mask-softmax kernel reads and writes them (4), dropout reads them and writes its output and a
# byte mask (5), probs·v reads them (2). It saves the softmax output, the mask and the dropout output
# (5: Korthikanti et al.'s 5as^2 per layer). Check: 22B at tp 8, micro-batch 4 gives 1.3 ms per layer
# for the core's forward, Korthikanti et al.'s measured selective-recompute cost (13.2 - 11.9 ms).
MEGATRON_SOFTMAX_IO_BYTES = 13.0
MEGATRON_SOFTMAX_SAVED_BYTES = 5.0


def _attention_as_run(k: dict[str, np.ndarray], workload, c: Coefficients) -> dict[str, np.ndarray]:
    """The per-kind figures as the runtime's attention kernels make them, plus `fused_attn_flops`
    (forward FLOPs of attention run by a fused kernel, whose backward recomputes the scores).
    torch runs the model file's own ops. Megatron-Core runs its own attention whatever the file
    writes: the file's core (traffic, saved bytes) is replaced by Megatron's, from the score count
    alone: none with flash attention, MEGATRON_SOFTMAX_* bytes per score without; the same core
    under another runtime with the `megatron_softmax` switch (Megatron-DeepSpeed's runs). Under
    runtime megatron the rest of each dense layer's traffic and saved bytes are Megatron-Core's
    too, from the architecture (cost/fused.py)."""
    k = dict(k)
    megatron = is_megatron(workload.runtime)
    if not megatron_attention(workload):
        k["fused_attn_flops"] = k["attn_flops"] - k["attn_core_flops"]
        return k
    flash = "flash_attn" in workload.switches
    profile = workload.profile
    scores = k["attn_scores"] * DTYPE_BYTES[profile.dtype] / 2  # per 16-bit element figures
    # io_bytes are priced at elementwise_traffic HBM bytes per profiled byte (the file's own ops, fused or
    # not); Megatron's 13 bytes per score are already HBM bytes of its fused kernels: undo that scale once
    core_io = np.zeros_like(scores) if flash else MEGATRON_SOFTMAX_IO_BYTES / c.elementwise_traffic * scores
    core_saved = np.zeros_like(scores) if flash else MEGATRON_SOFTMAX_SAVED_BYTES * scores
    # Megatron-Core's own fused layer, not the file's ops (cost/fused.py); the switch replaces the core only
    outside_core = k["io_bytes"] - k["attn_core_io_bytes"]
    if megatron:
        layer_io = megatron_layer_io(profile)
        outside_core = np.where(layer_io["dense"] > 0, layer_io["io_bytes"] * DTYPE_BYTES[profile.dtype] / 2,
                                outside_core)
    k["io_bytes"] = outside_core + core_io
    k["saved_bytes"] = k["saved_bytes"] - k["attn_core_bytes"] + core_saved
    k["saved_tp_bytes"] = k["saved_tp_bytes"] - k["attn_core_bytes"] + core_saved
    if megatron:  # and what its layers keep for backward, outside the core
        layer = megatron_layer_saved(profile)
        dense = layer["dense"] > 0
        k["saved_bytes"] = np.where(dense, layer["saved_bytes"] + core_saved, k["saved_bytes"])
        k["saved_tp_bytes"] = np.where(dense, layer["saved_tp_bytes"] + core_saved, k["saved_tp_bytes"])
        k["entry_saved_bytes"] = np.where(dense, layer["entry_saved_bytes"], k["entry_saved_bytes"])
    k["fused_attn_flops"] = k["attn_flops"] if flash else np.zeros_like(scores)
    k["attn_core_bytes"], k["attn_core_io_bytes"] = core_saved, core_io
    k["attn_core_flops"] = k["attn_flops"]  # what selective recompute reruns
    return k


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


@functools.lru_cache(maxsize=1 << 14)
def _group_links(cluster, degrees: tuple[tuple[str, int], ...], order: int) -> tuple:
    """The tp ring, the gradient ring (dp x cp), the pipeline neighbours' link and the ends' ring (None
    without pp) of one layout: a calibration evaluates the same few layouts thousands of times."""
    dims = axes.ParallelDims(dict(degrees), mesh_order_of(order))
    sizes, strides, pp = dims.degrees, dims.strides(), dims.degrees["pp"]
    return (cluster.ring(sizes["tp"], strides["tp"]),
            cluster.ring(*dims.gradient_group()),  # dp (x cp): the gradient group
            cluster.p2p(strides["pp"]) if pp > 1 else None,
            cluster.ring(2, (pp - 1) * strides["pp"]) if pp > 1 else None)  # the ends


def _links(cluster, pa: PlanArrays, coeffs: Coefficients) -> dict[str, np.ndarray]:
    """Effective bandwidth (bytes/s, efficiency applied) and latency of the tp, dp and pp groups,
    derived from the cluster graph once per distinct (degrees, mesh order)."""
    names = tuple(axes.AXES)
    first, inverse = unique_rows([getattr(pa, a) for a in names] + [pa.mesh_order])
    table = np.zeros((len(first), 8))
    for row, i in enumerate(first):
        degrees = tuple((a, int(getattr(pa, a)[i])) for a in names)
        for col, link in enumerate(_group_links(cluster, degrees, int(pa.mesh_order[i]))):
            if link is None:
                table[row, 2 * col:2 * col + 2] = (np.inf, 0.0)
            else:
                table[row, 2 * col] = link.bandwidth * coeffs.link(link.kind)
                table[row, 2 * col + 1] = link.latency * coeffs.latency_scale
    t = table[inverse.reshape(-1)]
    return {"tp_bw": t[:, 0], "tp_lat": t[:, 1], "dp_bw": t[:, 2], "dp_lat": t[:, 3],
            "pp_bw": t[:, 4], "pp_lat": t[:, 5], "tied_bw": t[:, 6], "tied_lat": t[:, 7]}


def _pipeline(workload, g: PlanArrays, c: Coefficients, floors: bool = False) -> dict[str, np.ndarray]:
    """Everything that does not depend on the data-parallel knobs (ZeRO, buckets, gradient dtype,
    offload): computed once per group of plans sharing degrees, micro-batching, schedule,
    recompute, sequence parallel, precision and mesh order. In named steps, each adding its
    figures to the group's (`x`): the group's columns and links, one micro-batch of each block kind
    on one GPU, of each representative pipeline rank by part, the host's pace, the schedule, the
    activations in flight, the tied embedding, (with `floors`, what the per-stage search's bound reads of
    each layer kind,) then the parts."""
    x = _group(workload, g, c)
    steps = (_per_kind, _per_rank, _host_paced, _schedule, _activations, _tied)
    for step in steps + ((_layer_floors,) if floors else ()):
        x.update(step(workload, g, c, x))
    return _parts(workload, g, x)


def _col(a) -> np.ndarray:
    """(G,) -> (G, 1)."""
    return np.asarray(a, dtype=float)[:, None]


def _take(x: dict, names: str) -> list:
    """The figures of the earlier steps a step reads, by name."""
    return [x[n] for n in names.split()]


def _sums(x: dict):
    """(G, K) per block kind -> (G, J) per representative rank (`on`), and over the layers alone (`on_layers`)."""
    counts, k = x["counts"], x["k"]
    on = lambda per_kind: np.einsum("gjk,gk->gj", counts, per_kind)  # noqa: E731
    on_layers = lambda per_kind: on(per_kind * k["is_layer"])  # noqa: E731
    return on, on_layers


def _group(workload, g: PlanArrays, c: Coefficients) -> dict:
    """The group's (G, 1) columns, its links, and the profile's per-kind figures as the runtime runs them."""
    profile, cluster = workload.profile, workload.cluster
    k = moe.dispatch_as_run(_attention_as_run(_kind_arrays(profile), workload, c), workload)
    k = cross_entropy.loss_as_run(k, workload)  # the loss priced from the logit count (head_times below)
    # (G, 1): TE userbuffers (Megatron's tp_comm_overlap), or torch's async TP, which micro-pipelines the
    # sequence-parallel all-gathers and reduce-scatters only
    tp_overlap = np.logical_or("tp_comm_overlap" in workload.switches,
                               ("async_tp" in workload.switches) & np.asarray(g.sequence_parallel, dtype=bool))[:, None]
    col = _col

    t, m, v, pp = col(g.tp), col(g.num_micro_batches), col(g.virtual_stages), col(g.pp)
    b = col(g.micro_batch_size) / col(sequence_share(g))  # samples' worth of tokens per rank (cp splits them)
    sp_div = np.where(g.sequence_parallel, g.tp, 1)[:, None].astype(float)  # sequence parallel shards the rest too
    act_scale = col(PRECISION_BYTES[g.precision] / DTYPE_BYTES[profile.dtype])
    # the bf16 rate for fp8 too: cost/precision.py scales the time of the GEMMs fp8 runs
    peak = col(np.array([cluster.gpu.peak_flops[storage_dtype(p)] for p in PRECISIONS])[g.precision])
    hbm_raw = cluster.gpu.hbm_bytes_per_s * c.hbm_efficiency  # HBM bytes counted as such (Megatron's own ops)
    hbm = hbm_raw / c.elementwise_traffic  # the model file's profiled bytes, fused as the fit found
    links = _links(cluster, g, c)
    tp_bw, tp_lat = col(links["tp_bw"]), col(links["tp_lat"])
    split = vocabulary.tp_split(workload, g.tp, len(profile.blocks))  # t; less at Megatron's padded ends
    counts = np.array([1] + [blk.count for blk in profile.layers] + [1], dtype=float)  # the ends count once
    return dict(profile=profile, profile_counts=counts, cluster=cluster, k=k, tp_overlap=tp_overlap, t=t, m=m, v=v,
                pp=pp, b=b, sp_div=sp_div, act_scale=act_scale, peak=peak, hbm_raw=hbm_raw, hbm=hbm, links=links,
                tp_bw=tp_bw, tp_lat=tp_lat, split=split)


def _per_kind(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """(G, K), one micro-batch of each block kind on one GPU: compute and tensor-parallel collectives of
    each pass, the routed experts (cost/moe.py), what selective recompute reruns, and the activations kept."""
    col = _col
    (profile, cluster, k, tp_overlap, t, b, sp_div, act_scale, peak, hbm_raw, hbm, tp_bw, tp_lat, split) = _take(x,
        "profile cluster k tp_overlap t b sp_div act_scale peak hbm_raw hbm tp_bw tp_lat split")
    flops_f = b * (k["tp_fwd_flops"] / split + (k["fwd_flops"] - k["tp_fwd_flops"]))
    flops_b = flops_f * _ratio(k["bwd_flops"], k["fwd_flops"])
    shape = kind_efficiency(profile, b[:, 0], g.tp, cluster.gpu.sms)  # tile and wave quantisation
    eff = c.gemm_efficiency * shape * flops_f / (flops_f + c.gemm_half_flops * shape)
    rate = peak * np.maximum(eff, 1e-9)
    scale = fp8.compute_scale(workload, g, b, sp_div, flops_f, c)  # fp8's GEMMs and casts, compile's fusion
    shard = _ratio(k["saved_tp_bytes"], k["saved_bytes"])
    io_f = b * act_scale * k["io_bytes"] * (shard / split + (1 - shard) / sp_div) / hbm * scale["elementwise"]
    base = c.collective_latency_s
    # per pass: a layer's backward mirrors its forward, the ends do not (cost/tensor_parallel.py)
    fwd_scale = fp8.tp_forward_scale(workload, g)  # the layers' forward TP bytes (fp8 gathers)
    tp_fwd, tp_bwd = tensor_parallel.pass_times(k, workload, b, act_scale, t, tp_bw, tp_lat, base, fwd_scale)
    compute_f = flops_f * scale["gemm"] / rate + io_f + scale["cast_f"]
    # a fused attention backward recomputes q·kᵀ: half its forward FLOPs again
    compute_b = (flops_b * scale["gemm"] + 0.5 * b * k["fused_attn_flops"] / t) / rate + 2 * io_f + scale["cast_b"]
    # Megatron's torch softmax where its fused kernel cannot run: more HBM passes over the scores
    unfused = softmax_fallback.fallback(workload, g.micro_batch_size, g.tp, SIXTEEN_BIT[g.precision])
    score_io = unfused * b * k["attn_scores"] / t / hbm_raw
    compute_f = compute_f + softmax_fallback.FALLBACK_IO_BYTES[0] * score_io
    compute_b = compute_b + softmax_fallback.FALLBACK_IO_BYTES[1] * score_io
    if cross_entropy.applies(workload):  # Megatron's fp32 loss instead of the file's (loss_as_run above)
        loss_f, loss_b = cross_entropy.head_times(workload, b, t, hbm_raw, compute_f.shape[1])
        compute_f, compute_b = compute_f + loss_f, compute_b + loss_b
    routed = moe.pipeline_terms(workload, g, c, b, sp_div, col(PRECISION_BYTES[g.precision]), peak)
    compute_f, compute_b = compute_f + routed["expert_f"], compute_b + routed["expert_b"]
    # overlapped (TE userbuffers, async TP): each pass's collective in t chunks under that pass's GEMMs,
    # under all of them for TE, under `async_tp_overlap` of them for async TP (fitted, cost/torch_runtime.py)
    under = 1.0 if "tp_comm_overlap" in workload.switches else c.async_tp_overlap
    tp_f = np.where(tp_overlap, np.maximum(tp_fwd - under * flops_f / rate, tp_fwd / t), tp_fwd)
    tp_b = np.where(tp_overlap, np.maximum(tp_bwd - under * flops_b / rate, tp_bwd / t), tp_bwd)
    attn_io = b * act_scale * k["attn_core_io_bytes"] / t / hbm  # the core is split by heads
    selective_f = b * k["attn_core_flops"] / t / rate + attn_io
    # the loss's saved tensors apart: it reads the whole sequence's logits (cost/cross_entropy.py)
    kept_tp = k["saved_tp_bytes"] - k["loss_saved_tp_bytes"]
    kept = k["saved_bytes"] - k["loss_saved_bytes"] - kept_tp - k["entry_saved_bytes"]
    # a column-wise linear's input: torch's DTensor linear saves it as gathered along the sequence, whole
    # on every rank; Megatron's saves its sequence shard and gathers it again in backward
    entry_div = sp_div if is_megatron(workload.runtime) else 1.0
    act_full = (b * act_scale * (kept_tp / split + kept / sp_div + k["entry_saved_bytes"] / entry_div)
                - scale["saved"] + cross_entropy.saved_as_run(k, workload, b, act_scale, split))
    act_sel = act_full - b * act_scale * k["attn_core_bytes"] / t
    if op_sac.applies(workload):  # torchtitan's per-op checkpoint instead of the attention core's
        selective_f = op_sac.recompute_time(workload, g, b, t, rate, scale["gemm"], flops_f, io_f, tp_f, fwd_scale)
        act_sel = op_sac.kept_bytes(workload, b, act_scale, t, sp_div, act_sel)
    act_ckpt = b * act_scale * k["out_bytes"] / sp_div
    return dict(base=base, scale=scale, tp_fwd=tp_fwd, tp_bwd=tp_bwd, compute_f=compute_f, compute_b=compute_b,
                unfused=unfused, routed=routed, tp_f=tp_f, tp_b=tp_b, selective_f=selective_f, act_full=act_full,
                act_sel=act_sel, act_ckpt=act_ckpt)


def _per_rank(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """(G, J), one micro-batch, forward and backward, on each representative pipeline rank, by part:
    compute, tensor- and expert-parallel collectives, recompute, the pipeline's point-to-point sends."""
    col = _col
    (k, t, v, pp, b, sp_div, act_scale, links, tp_bw, tp_lat, base, compute_f, compute_b, tp_fwd, tp_bwd,
     tp_f, tp_b, routed, selective_f) = _take(x,
        "k t v pp b sp_div act_scale links tp_bw tp_lat base compute_f compute_b tp_fwd tp_bwd tp_f "
        "tp_b routed selective_f")
    reps = g.splits.stacked(g.split)
    counts, rank, last, n_layers, mult = reps["counts"], reps["rank"], reps["last"], reps["layers"], reps["mult"]
    on, on_layers = _sums({"counts": counts, "k": k})
    mode = col(g.recompute)
    ckpt_frac = np.where(mode == FULL, _ratio(np.minimum(col(g.recompute_blocks), n_layers), n_layers), 0.0)
    compute = on(compute_f + compute_b)
    tp_comm = on(tp_f + tp_b)
    ep_comm = on(routed["a2a_f"] + routed["a2a_b"])
    tp_hidden = on(tp_fwd + tp_bwd) - tp_comm
    recompute = np.select([mode == FULL, mode == SELECTIVE],
                          [ckpt_frac * on_layers(compute_f + tp_f + routed["a2a_f"]), on_layers(selective_f)], 0.0)
    # per-stage recompute (SplitTable): each rank's blocks recomputed fully and selectively, per kind
    # (all zero for a uniform plan, whose recompute is priced above from its mode and share of blocks)
    full, sel = reps["full"], reps["sel"]
    recompute = recompute + (np.einsum("gjk,gk->gj", full, compute_f + tp_f + routed["a2a_f"])
                             + np.einsum("gjk,gk->gj", sel, selective_f))
    # boundary activations ~ the hidden states; Megatron's scatter/gather sends 1/t of them from each
    # tensor-parallel rank (and all-gathers them over the node's links), as sequence parallelism does
    scatter_gather = is_megatron(workload.runtime)
    p2p_bytes = b * act_scale * k["out_bytes"][0] / (t if scatter_gather else sp_div)
    p2p_one = np.where(pp > 1, p2p_bytes / col(links["pp_bw"]) + (col(links["pp_lat"]) + base), 0.0)
    if scatter_gather:  # the receiving stage all-gathers the pieces over its tensor-parallel group
        gathered = np.where(t > 1, all_gather_time(p2p_bytes * t, t, tp_bw, tp_lat, base), 0.0)
        p2p_one = p2p_one + np.where(pp > 1, gathered, 0.0)
    p2p = 2 * v * p2p_one * np.ones_like(compute)
    if "overlap_p2p_comm" in workload.switches:  # interleaved: each chunk's sends and receives run under the
        p2p = np.where(v > 1, p2p / (2 * v), p2p)  # next chunk's compute; one per micro-batch stays exposed
    return dict(counts=counts, rank=rank, last=last, n_layers=n_layers, mult=mult, mode=mode, ckpt_frac=ckpt_frac,
                full=full, sel=sel, compute=compute, tp_comm=tp_comm, ep_comm=ep_comm, tp_hidden=tp_hidden, recompute=recompute,
                p2p=p2p)


def _host_paced(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """(G, J): each rank's micro-batch on the GPU, and paced by the host's kernel launches where they
    take longer than the GPU can hide."""
    (k, t, counts, n_layers, mode, ckpt_frac, unfused, compute, tp_comm, ep_comm, recompute, p2p, full, sel) = _take(x,
        "k t counts n_layers mode ckpt_frac unfused compute tp_comm ep_comm recompute p2p full sel")
    gpu_mb = compute + tp_comm + ep_comm + recompute + p2p  # one micro-batch, forward + backward, on each rank
    host = c.host
    if host:  # the host launches every block's kernels (through DTensor under TP); the GPU hides what it can
        per_layer = c.block_host_s + c.launch_s * launches.layer_launches(k, workload)  # launch default + fitted
        per_pass = (per_layer + np.where(t > 1, c.tp_host_s, 0.0)) * fp8.host_scale(g, c)
        # recompute replays the forward of its blocks (selective too: the checkpoint reruns every op,
        # returning the kept outputs of all but the attention core)
        replayed = np.where(mode == SELECTIVE, n_layers, ckpt_frac * n_layers)
        checkpointing = np.where(mode == SELECTIVE, c.selective_host_s, 0.0) * n_layers
        n_sel = sel.sum(axis=2)  # per-stage recompute's blocks (none under a uniform plan)
        replayed, checkpointing = replayed + full.sum(axis=2) + n_sel, checkpointing + c.selective_host_s * n_sel
        # each block's launches in layers' worth (cost/launches.py): an embedding issues far fewer
        weights = launches.block_weights(k, workload)
        launched = np.einsum("gjk,k->gj", counts, weights)
        host_mb = per_pass * (3 * launched + replayed) + checkpointing
        # the torch softmax's extra operations, in every pass of every layer
        host_mb = host_mb + (unfused * per_pass * (3 * n_layers + replayed)
                             * softmax_fallback.FALLBACK_EXTRA_OPS / softmax_fallback.FUSED_LAYER_OPS)
        # CUDA graphs replay the layers' kernels (recompute included) in one launch: the ends' stay
        ends = np.einsum("gjk,k->gj", counts, launches.end_weights(weights))
        host_mb = np.where(np.asarray(g.cuda_graphs, dtype=bool)[:, None], per_pass * 3 * ends, host_mb)
        per_mb = _norm(gpu_mb, host_mb, c.host_overlap)
    else:
        per_mb, host_mb = gpu_mb, np.zeros_like(gpu_mb)
    return dict(gpu_mb=gpu_mb, host=host, per_mb=per_mb, host_mb=host_mb)


def _schedule(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """The pipeline of m micro-batches: the sum over ranks and (m - 1) x the slowest (interleaved: over v),
    and the slowest rank, whose parts the breakdown reports. The zero-bubble schedules leave less of
    each other rank's micro-batch idle: its W (weight-gradient) passes fill the bubble (cost/zero_bubble.py)."""
    (m, v, per_mb, mult, k, compute_b, tp_b) = _take(x, "m v per_mb mult k compute_b tp_b")
    slowest = per_mb.max(axis=1)
    total = (per_mb * mult).sum(axis=1)
    m1, v1 = m[:, 0], v[:, 0]
    pipe = np.where(v1 > 1, total / v1 + (m1 - 1 / v1) * slowest, total + (m1 - 1) * slowest)
    sched = _col(g.schedule)
    on, _ = _sums(x)
    weight = on(compute_b * zero_bubble.weight_share(k))
    if zero_bubble.applies(sched).any():
        zb = zero_bubble.pipe(sched, per_mb, mult, weight, on(compute_b + tp_b), m, v)
        pipe = np.where(zero_bubble.applies(sched[:, 0]), zb, pipe)
    share = zero_bubble.rank_share(sched, per_mb, weight, on(compute_b + tp_b), v)
    at_slowest = np.argmax(per_mb, axis=1)[:, None]
    return dict(slowest=slowest, m1=m1, pipe=pipe, at_slowest=at_slowest, share=share, weight=weight)


def _activations(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """(G, J): the activations each rank keeps in flight under its schedule and recompute, and the
    largest layer's parameters (ZeRO-3 gathers two at a time)."""
    col = _col
    (k, t, m, v, pp, mode, ckpt_frac, rank, last, counts, act_full, act_sel, act_ckpt, full, sel) = _take(x,
        "k t m v pp mode ckpt_frac rank last counts act_full act_sel act_ckpt full sel")
    on, on_layers = _sums(x)
    per_kind_act = np.where(mode == SELECTIVE, act_sel, act_full)
    act_mb = (on_layers(per_kind_act) * (1 - ckpt_frac) + on_layers(act_ckpt) * ckpt_frac
              + on(per_kind_act * (1 - k["is_layer"])))
    # per-stage recompute (a uniform plan has none): a fully recomputed block keeps its output, a selective one
    # all but its attention core
    act_mb = act_mb + np.einsum("gjk,gk->gj", full, act_ckpt - act_full) + np.einsum("gjk,gk->gj", sel, act_sel - act_full)
    sched = col(g.schedule)
    in_flight = micro_batches_kept(sched, pp, m, v, rank)
    # the head ends the last chunk, whose backward follows each forward at once: one micro-batch's
    # worth in flight (GPipe: all of them), not the rank's average over its chunks
    head_act = counts[:, :, -1] * per_kind_act[:, -1:]
    head_in_flight = np.where(sched == GPIPE, m, 1.0)
    kept = (act_mb - head_act) * in_flight
    # zero-bubble: its own peak count, and the deferred W passes' inputs, all but the attention core's, at
    # the class's worst rank (cost/zero_bubble.py)
    if zero_bubble.applies(sched).any():
        zb = zero_bubble.worst_in_flight(sched, pp, m, v, rank, last, act_mb - head_act, on_layers(act_sel))
        kept = np.where(zero_bubble.applies(sched), zb, kept)
    working = np.where((ckpt_frac > 0) | (full.sum(axis=2) > 0), (act_full * k["is_layer"]).max(axis=1, keepdims=True),
                       0.0)
    block_params = ((k["tp_params"] / t + k["params"] - k["tp_params"]) * k["is_layer"]).max(axis=1)
    # the least a rank's blocks can keep, whatever their recompute and the rank's place: every block its least
    # activation once (a rank keeps at least one micro-batch in flight, one chunk's worth of its v)
    least_per_kind = np.minimum(np.minimum(act_full, act_sel), act_ckpt)  # one block, whatever its recompute
    return {"activations": kept + head_act * head_in_flight + working, "block_params": block_params,
            "least_per_kind": least_per_kind, "least_activations": on_layers(least_per_kind) / v}


def _per_expert_param(experts: dict, expert_local: np.ndarray) -> np.ndarray:
    """(N, 1) bytes of model states per routed-expert parameter on a GPU (cost/moe.py's, linear in them)."""
    held = expert_local > 0
    per = (experts["expert_weights"] + experts["expert_optimizer"]) / np.where(held, expert_local, 1.0)
    least = np.where(held, per, np.inf).min(axis=1, keepdims=True)
    return np.where(np.isfinite(least), least, 0.0)


def micro_batches_kept(sched, pp, m, v, rank):
    """Micro-batches' worth of its blocks' activations rank `rank` keeps at its peak: GPipe all m,
    1F1B min(pp - rank, m), interleaved its warm-up chunks over v; the zero-bubble schedules' own counts
    (`zero_bubble.in_flight`: what they keep, besides the deferred W passes' inputs)."""
    chunks = np.minimum((pp - rank - 1) * 2 + (v - 1) * pp + 1, m * v)
    plain = np.select([sched == GPIPE, sched == INTERLEAVED], [m, chunks / v], np.minimum(pp - rank, m))
    return np.where(zero_bubble.applies(sched), zero_bubble.in_flight(sched, pp, m, v, rank)[0], plain)


def _layer_floors(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """What `stages.recompute_floors` needs of each layer kind (G, K), one layer on one GPU: its parameters
    (dense, and routed experts'), its activations kept without recompute and with the most, its passes'
    seconds, and h(d) = max(r1 d, r2 d + k2) under the seconds of recompute that save d bytes of its
    activations (its options, selective and full, as points (bytes saved, seconds): their lower convex hull
    through (0, 0) is at least its first slope r1 times d and at least its second segment's line), the seconds
    a byte costs with full recompute alone (the zero-bubble schedules run no selective), what its deferred W
    passes hold (zero-bubble: its inputs less the attention core's, whatever the recompute); and (G,) the ends'
    passes and a rank's point-to-point time."""
    k, split, act_full, act_sel, act_ckpt = _take(x, "k split act_full act_sel act_ckpt")
    points = [(act_full - act_sel, x["selective_f"]),
              (act_full - act_ckpt, x["compute_f"] + x["tp_f"] + x["routed"]["a2a_f"])]
    (da, ta), (db, tb) = points
    swap = da > db  # (da, ta): the option that saves less
    (da, ta), (db, tb) = ((np.where(swap, db, da), np.where(swap, tb, ta)),
                          (np.where(swap, da, db), np.where(swap, ta, tb)))
    ratio = lambda t, d: np.where(d > 0, t / np.where(d > 0, d, 1.0), np.inf)  # noqa: E731
    ra, rb = ratio(ta, da), ratio(tb, db)
    first = np.minimum(ra, rb)
    bend = (ra < rb) & (db > da)  # the hull turns at the option that saves less
    second = np.where(bend, (tb - ta) / np.where(bend, db - da, 1.0), first)
    passes = x["compute_f"] + x["compute_b"] + x["tp_f"] + x["tp_b"] + x["routed"]["a2a_f"] + x["routed"]["a2a_b"]
    layers = x["profile_counts"] * k["is_layer"] * np.ones_like(act_full)
    params = (k["tp_params"] / split + (k["params"] - k["tp_params"])) * np.ones_like(act_full)
    return {"kind_layers": layers, "kind_params": params,
            "kind_expert_params": x["routed"]["expert_params"] * np.ones_like(act_full),
            "kind_activations": act_full, "kind_least_activations": x["least_per_kind"], "kind_seconds": passes,
            "kind_rate": first, "kind_rate2": second,
            "kind_intercept": np.where(bend, ta - np.where(bend, second, 0.0) * da, 0.0),
            "kind_full_rate": ratio(points[1][1], points[1][0]), "kind_held": act_sel,
            "first_seconds": passes[:, 0], "last_seconds": passes[:, -1], "rank_p2p": x["p2p"].min(axis=1)}


def _tied(workload, g: PlanArrays, c: Coefficients, x: dict) -> dict:
    """(G, J): the tied embedding weights each rank all-reduces with the other end, and the copy the last holds."""
    (profile, split, counts, pp) = _take(x, "profile split counts pp")
    # tied embeddings over a pipeline: the last stage keeps a copy of the embedding's weight, and the two
    # ends all-reduce its gradient every step (Megatron's embedding group, DeepSpeed's tied modules,
    # autopar's executor/tied.py)
    tied = profile.tied_tp_params / split[:, -1:] + (profile.tied_params - profile.tied_tp_params)  # (G, 1)
    ends = (counts[:, :, 0] > 0) | (counts[:, :, -1] > 0)
    # a V (zbv, dualpipev) puts both ends on rank 0: two copies there, summed on the rank (no all-reduce)
    both = (counts[:, :, 0] > 0) & (counts[:, :, -1] > 0) & (pp > 1)
    tied_rank = np.where(ends & (pp > 1) & ~both, tied, 0.0)  # (G, J): what each rank all-reduces with the other end
    tied_copy = np.where(both, tied, np.where(counts[:, :, 0] > 0, 0.0, tied_rank))
    return dict(tied_rank=tied_rank, tied_copy=tied_copy)


def _parts(workload, g: PlanArrays, x: dict) -> dict[str, np.ndarray]:
    """What `evaluate` reads: the slowest rank's parts over the micro-batches, and per rank what the
    data-parallel step and memory need."""
    (profile, k, split, scale, routed, compute_f, compute_b, tp_f, tp_b, counts, mult, mode, ckpt_frac,
     compute, recompute) = _take(x,
        "profile k split scale routed compute_f compute_b tp_f tp_b counts mult mode ckpt_frac "
        "compute recompute")
    (tp_comm, ep_comm, p2p, tp_hidden, gpu_mb, host, per_mb, slowest, m1, pipe, at_slowest, tied_rank,
     tied_copy) = _take(x,
        "tp_comm ep_comm p2p tp_hidden gpu_mb host per_mb slowest m1 pipe at_slowest tied_rank "
        "tied_copy")
    on, _ = _sums(x)
    at = lambda part: np.take_along_axis(part, at_slowest, axis=1)[:, 0] * m1  # noqa: E731
    total_counts = x["profile_counts"]
    recompute_flops = np.select([mode == FULL, mode == SELECTIVE],
                                [ckpt_frac * (counts * (k["fwd_flops"] * k["is_layer"])).sum(axis=2),
                                 (counts * (k["attn_core_flops"] * k["is_layer"])).sum(axis=2)], 0.0)
    recompute_flops = recompute_flops + (np.einsum("gjk,k->gj", x["full"], k["fwd_flops"])
                                         + np.einsum("gjk,k->gj", x["sel"], k["attn_core_flops"]))
    return {
        "pipe": pipe, "pp_bubble": pipe - m1 * slowest, "compute": at(compute), "recompute": at(recompute),
        "tp_comm": at(tp_comm), "ep_comm": at(ep_comm), "pp_p2p": at(p2p),
        "host": at(per_mb - gpu_mb) if host else np.zeros(len(g)),
        "hidden_tp_comm": at(tp_hidden),
        "backward_s": on(compute_b + tp_b), "forward_s": on(compute_f + tp_f),
        "local_params": on(k["tp_params"] / split + (k["params"] - k["tp_params"])) + tied_copy,
        "linear_params": on(scale["weights"]),  # what fp8 casts (cost/precision.py)
        "tied_params": tied_rank,
        "expert_local": on(routed["expert_params"]),
        "activations": x["activations"],
        "least_activations": x["least_activations"],
        **{name: x[name] for name in LAYER_FLOORS if name in x},
        "block_params": x["block_params"],
        "model_flops_per_sample": np.full(len(g), _model_flops(profile, k, total_counts)),
        "recompute_flops_per_sample": (recompute_flops * mult).sum(axis=1),
        # per rank, what the per-stage solver combines (`evaluate(..., ranks=True)`)
        "per_mb": per_mb, "gpu_mb": gpu_mb, "host_mb": x["host_mb"], "mult": mult,
        "share": x["share"], "weight": x["weight"],
    }


def _model_flops(profile, k: dict, counts: np.ndarray) -> float:
    """Model FLOPs of one sample, forward and backward, the routed experts included (`_kind_arrays`
    leaves them to cost/moe.py's pricing, not to the count MFU divides)."""
    experts = moe.expert_kind_arrays(profile)
    per_kind = k["fwd_flops"] + k["bwd_flops"] + experts["expert_fwd_flops"] + experts["expert_bwd_flops"]
    return float((counts * per_kind).sum())


def _dp_hiding(workload, c: Coefficients, backward_s: np.ndarray, forward_s: np.ndarray):
    """Seconds of one micro-batch's backward and forward under which data-parallel collectives hide:
    torch's DDP / FSDP2 buckets hide `dp_overlap` of them (fitted: launch order and stream contention
    decide); Megatron-Core all of them, but only with its overlap switch on (else they run after)."""
    if is_megatron(workload.runtime):
        return ((1.0 if "overlap_grad_reduce" in workload.switches else 0.0) * backward_s,
                (1.0 if "overlap_param_gather" in workload.switches else 0.0) * forward_s)
    return c.dp_overlap * backward_s, c.dp_overlap * forward_s


def _norm(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    """(a^p + b^p)^(1/p) for non-negative a, b: a + b at p = 1, max(a, b) as p grows."""
    top = np.maximum(a, b)
    scale = np.where(top > 0, top, 1.0)
    return top * ((a / scale) ** p + (b / scale) ** p) ** (1 / p)


DP_ONLY = ("zero", "offload_optimizer", "bucket_mb", "grad_comm_dtype")  # read outside _pipeline only


def _groups(pa: PlanArrays) -> tuple[np.ndarray, np.ndarray]:
    """Index of the first plan of each group (plans equal but in DP_ONLY fields) and each plan's group."""
    return unique_rows([v for k, v in pa.columns.items() if k not in DP_ONLY])


class _Expanded(dict):
    """The groups' figures (`_pipeline`), each expanded to the plans (`inverse`) when first read: a search
    without the per-rank figures (`ranks`) never pays for them."""

    def __init__(self, groups: dict[str, np.ndarray], inverse: np.ndarray):
        super().__init__()
        self.groups, self.inverse = groups, inverse

    def __missing__(self, name: str) -> np.ndarray:
        self[name] = value = self.groups[name][self.inverse]
        return value

    def __contains__(self, name) -> bool:
        return name in self.groups


def evaluate(workload, pa: PlanArrays, coeffs: Coefficients | None = None,
             ranks: bool = False) -> dict[str, np.ndarray]:
    """Iteration time, its breakdown, and peak memory per GPU with its breakdown, for every
    plan in `pa`. Returns a dict of arrays of length N (keys: time_parts(), HIDDEN_PARTS, memory_parts(),
    iteration_time, peak_memory, fits, model_flops, hw_flops)."""
    cluster = workload.cluster
    c = coeffs if coeffs is not None else Coefficients.for_cluster(cluster, workload.runtime)
    first, inverse = _groups(pa)
    part = _Expanded(_pipeline(workload, pa.take(first), c, floors=ranks), inverse)
    col = lambda a: np.asarray(a, dtype=float)[:, None]  # noqa: E731  (N,) -> (N, 1)

    # -- data parallel and optimizer, per representative rank: (N, J) ----------------------------------
    links = _links(cluster, pa, c)
    zero, dpn = col(pa.zero), col(gradient_group_size(pa))  # dp x cp reduce gradients together
    dp_bw, dp_lat = col(links["dp_bw"]), col(links["dp_lat"])
    # HSDP (cost/hsdp.py): ZeRO's collectives and states over each replica's shard group (dp x cp /
    # dp_replicate), its gradient shards all-reduced across the replicas; without replicas, the whole group
    hs = hsdp.groups(cluster, pa, c, dpn, dp_bw, dp_lat)
    shard, shard_bw, shard_lat = hs["shard"], hs["shard_bw"], hs["shard_lat"]
    local_params = part["local_params"]
    hide_b, hide_f = _dp_hiding(workload, c, part["backward_s"], part["forward_s"])
    megatron = is_megatron(workload.runtime)
    grad_bytes = local_params * col(COMM_BYTES[pa.grad_comm_dtype])
    prec_bytes = col(PRECISION_BYTES[pa.precision])
    param_bytes = local_params * prec_bytes
    bucket = col(pa.bucket_mb) * 2**20
    n_buckets = np.ceil(grad_bytes / bucket)
    base = c.collective_latency_s
    reduce_all = 2 * (dpn - 1) / dpn * grad_bytes / dp_bw + n_buckets * 2 * (dpn - 1) * dp_lat
    if base:
        reduce_all = reduce_all + n_buckets * base
    last_bucket = all_reduce_time(np.minimum(grad_bytes, bucket), dpn, dp_bw, dp_lat, base)
    scatter_all = (all_gather_time(grad_bytes, shard, shard_bw * c.collective("reduce_scatter"), shard_lat, base)
                   + hsdp.replica_reduce(grad_bytes, hs, base))
    gather = all_gather_time(param_bytes * fp8.gather_scale(workload, pa), shard,
                             shard_bw * c.collective("all_gather"), shard_lat, base)
    broadcast = all_gather_time(param_bytes, shard, shard_bw * c.collective("broadcast"), shard_lat, base)
    nmb = col(pa.num_micro_batches)
    accumulate = ((pa.pp > 1) & (pa.num_micro_batches > 1))[:, None]

    def exposed(hide_b, hide_f):
        """The data-parallel collectives' time on the critical path, given what can hide them.
        FSDP2 reduce-scatters after every micro-batch's backward (gradients stay sharded) unless the
        pipeline schedule accumulates them unsharded and reduces once, after the last micro-batch
        (torch.distributed.pipelining does with more than one micro-batch); ZeRO-2 keeps the gathered
        parameters across micro-batches, ZeRO-3 gathers them for each forward and backward.
        Megatron's distributed optimizer (ZeRO-1) reduce-scatters gradients and all-gathers
        parameters in buckets; ZeroRedundancyOptimizer all-reduces and broadcasts."""
        ddp = np.maximum(reduce_all - hide_b, last_bucket)
        scatters = np.where(accumulate, 1.0, nmb) * np.maximum(scatter_all - hide_b, scatter_all / n_buckets)
        distributed = (np.maximum(scatter_all - hide_b, scatter_all / n_buckets)
                       + np.maximum(gather - hide_f, gather / n_buckets))
        t = np.select(
            [zero == 0, zero == 1, zero == 2],
            [ddp, distributed if megatron else ddp + broadcast, scatters + np.maximum(gather - hide_f, 0)],
            scatters + nmb * np.maximum(2 * gather - hide_f - hide_b, (shard - 1) * shard_lat + base))
        return np.where(dpn > 1, t, 0.0)

    def exposed_floor(hide_b, hide_f):
        """What `exposed` never goes below, affine in the rank's parameters and hiding time (buckets counted
        fractionally, each max at its first argument): summed over the ranks the same for every split."""
        reduce_lin = 2 * (dpn - 1) / dpn * grad_bytes / dp_bw + grad_bytes / bucket * (2 * (dpn - 1) * dp_lat + base)
        k = np.where(accumulate, 1.0, nmb)
        t = np.select(
            [zero == 0, zero == 1, zero == 2],
            [reduce_lin - hide_b,
             scatter_all + gather - hide_b - hide_f if megatron else reduce_lin - hide_b + broadcast,
             k * (scatter_all - hide_b) + gather - hide_f],
            k * (scatter_all - hide_b) + nmb * (2 * gather - hide_f - hide_b))
        return np.where(dpn > 1, t, 0.0)

    offload = np.asarray(pa.offload_optimizer, dtype=bool)[:, None]
    fp32 = (pa.precision == PRECISIONS.index("fp32"))[:, None]
    experts = moe.data_parallel_terms(workload, pa, c, part["expert_local"], zero, nmb, accumulate, prec_bytes,
                                      col(COMM_BYTES[pa.grad_comm_dtype]), fp32, offload,
                                      col(pa.micro_batch_size), col(np.where(pa.sequence_parallel, pa.tp, 1)))
    # the expert gradients' collectives (over edp) share backward's hiding with the dense ones
    edp = experts["edp_s"]
    tied = np.where(part["tied_params"] > 0,  # after backward, before the step: exposed
                    all_reduce_time(part["tied_params"] * col(COMM_BYTES[pa.grad_comm_dtype]), 2,
                                    col(links["tied_bw"]), col(links["tied_lat"]), base), 0.0)
    dp_time = exposed(np.maximum(hide_b - edp, 0.0), hide_f) + np.maximum(edp - hide_b, 0.0) + tied
    dp_hidden = exposed(0.0 * hide_b, 0.0 * hide_f) + edp + tied - dp_time
    shard_states = np.where(zero >= 1, shard, 1.0)
    opt_params = local_params / shard_states + experts["opt_params"]
    hbm = cluster.gpu.hbm_bytes_per_s * c.hbm_efficiency
    optimizer = np.where(offload,
                         opt_params * c.optimizer_bytes_per_param / c.host_bytes_per_s
                         + opt_params * 6 / c.host_link_bytes_per_s,  # fp32 grads down, 16-bit params up
                         opt_params * c.optimizer_bytes_per_param / hbm)
    at_tail = np.argmax(dp_time + optimizer, axis=1)[:, None]
    dp_exposed = np.take_along_axis(dp_time, at_tail, axis=1)[:, 0]
    dp_hidden = np.take_along_axis(dp_hidden, at_tail, axis=1)
    opt_exposed = np.take_along_axis(optimizer, at_tail, axis=1)[:, 0]

    # -- memory per representative rank ----------------------------------------------------------------
    # accumulating unsharded, the pipeline schedule also keeps every block gathered from its backward
    # to its next forward: then ZeRO-2 and 3 hold whole gradients and (3) whole weights
    unsharded = accumulate & (zero >= 2)
    sharded_weights = (zero == 3) & ~unsharded
    # the model states' bytes per local parameter: linear in the blocks a rank holds
    per_param = {"weights": prec_bytes / np.where(sharded_weights, shard, 1.0),
                 "gradients": prec_bytes / np.where((zero >= 2) & ~unsharded, shard, 1.0),
                 "master_weights": np.where(fp32 | offload, 0.0, 4 / shard_states),
                 "optimizer_states": np.where(offload, 0.0, 8 / shard_states)}
    own_weights = local_params * per_param["weights"]
    weights = own_weights \
        + np.where(sharded_weights, 2 * col(part["block_params"]) * prec_bytes, 0.0) \
        + fp8.fp8_weight_bytes(workload, pa, part["linear_params"])  # two gathered blocks; fp8 copies
    mem = {
        "weights": weights,
        **{name: local_params * per_param[name] for name in ("gradients", "master_weights", "optimizer_states")},
        "activations": part["activations"],
        "comm_buffers": np.where((dpn > 1) & (zero <= 1), np.minimum(grad_bytes, bucket), 0.0),
        "workspace": np.full_like(weights, c.workspace_bytes),
        **{name: experts[name] for name in moe.MEMORY_PARTS},
    }
    for k in knobs():  # terms of axes and knobs the core model does not know
        if k.memory_term is not None:
            mem[f"{k.name}_memory"] = col(k.memory_term(workload, pa, c)) * np.ones_like(weights)
    peak_rank = sum(mem.values())
    at_peak = np.argmax(peak_rank, axis=1)[:, None]

    out = {name: part[name] for name in (*TIME_PARTS, *HIDDEN_PARTS) if name in part}  # those the pipeline prices
    out["hidden_dp_comm"] = dp_hidden[:, 0]
    extra_time = np.zeros(len(pa))
    for k in knobs():
        if k.time_term is not None:
            out[k.name] = np.asarray(k.time_term(workload, pa, c), dtype=float)
            extra_time = extra_time + out[k.name]
    out.update({
        "dp_comm": dp_exposed, "optimizer": opt_exposed,
        "overhead": part["host"] + c.step_overhead_s,
        "iteration_time": part["pipe"] + dp_exposed + opt_exposed + c.step_overhead_s + extra_time,
        "peak_memory": np.take_along_axis(peak_rank, at_peak, axis=1)[:, 0],
        "model_flops": part["model_flops_per_sample"] * workload.global_batch,
        "hw_flops": (part["model_flops_per_sample"] + part["recompute_flops_per_sample"]) * workload.global_batch,
    })
    out.update({name: np.take_along_axis(value, at_peak, axis=1)[:, 0] for name, value in mem.items()})
    out["fits"] = out["peak_memory"] <= workload.memory_budget
    if ranks:  # per representative rank (N, J): iteration = the pipe (the ranks' rank_share less the slowest's,
        # + m x the slowest rank_per_mb) + max of rank_tail + rank_const
        out.update(rank_per_mb=part["per_mb"], rank_gpu_mb=part["gpu_mb"], rank_host_mb=part["host_mb"],
                   rank_mult=part["mult"], rank_share=part["share"], rank_weight=part["weight"],
                   rank_tail=dp_time + optimizer, rank_optimizer=optimizer, rank_memory=peak_rank,
                   # dp_time >= it: `exposed` is at least its affine floor, which falls at least 1 s a second of
                   # hiding (every ZeRO stage), so the experts' collectives (edp, affine in the rank's experts:
                   # shared with the dense ones' hiding, or exposed past it) add at least edp
                   rank_dp_floor=exposed_floor(hide_b, hide_f) + np.where(dpn > 1, edp, 0.0),
                   # what no split or recompute lowers below, summed over the ranks (`stages.lower_bound`): the
                   # model states (linear in the blocks a rank holds), the workspace, the least activations
                   rank_least_memory=sum(mem[n] for n in ("gradients", "master_weights", "optimizer_states",
                                                           "workspace"))
                   + own_weights + part["least_activations"],
                   rank_const=c.step_overhead_s + extra_time,
                   # each layer kind's figures (`_layer_floors`), its model states in bytes among them (the
                   # experts' states per parameter as cost/moe.py keeps them)
                   kind_states=part["kind_params"] * sum(per_param.values()).min(axis=1, keepdims=True)
                   + part["kind_expert_params"] * _per_expert_param(experts, part["expert_local"]),
                   **{name: part[name] for name in LAYER_FLOORS})
    unpriced = [p for p in (*time_parts(), *HIDDEN_PARTS, *memory_parts()) if p not in out]
    if unpriced:  # a part declared in TIME_PARTS, MEMORY_PARTS or HIDDEN_PARTS that nothing above computes
        raise RuntimeError(f"the cost model declares {unpriced} but does not price them (autopar/cost/model.py)")
    return out
