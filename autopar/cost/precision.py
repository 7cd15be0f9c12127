"""What fp8 training and torch.compile change in a plan's cost (docs/hardware.md, "FP8 and compile").

FP8 training (torchao's float8 recipes under the torch runtime, Transformer Engine's under
megatron) runs the transformer layers' linear GEMMs with fp8 inputs; everything else (attention's
core, norms, the output head, weights, gradients, optimizer) stays in bf16. It costs:

- the GEMMs at the fp8 rate: `fp8_gemm_speedup` times the bf16 rate for a large GEMM (the
  measured ceilings differ: fp8 reaches a lower share of its doubled peak), and a size curve
  whose half point scales with the doubled peak (small GEMMs gain little or lose);
- the casts: torchao's per GEMM operand and pass as its own roofline counts them (`CAST_BYTES`;
  rowwise transposes in bf16 and casts again, so it moves more than tensorwise), under torchtitan's
  float8 TP (the `float8_tp` switch) on the sequence shard before an fp8 all-gather
  (`float8_tp_gathers`); Transformer Engine fuses the amax
  into a cast-transpose and keeps the weights' fp8 copies for the whole iteration;
- memory: Transformer Engine saves the fp8 copies of GEMM inputs for backward (torchao saves the
  bf16 input and casts again; `te_saved_credit` says which copies replace which bf16 tensors) and
  keeps an fp8 copy of the weights next to the bf16 ones for the iteration (cast once, at the
  first micro-batch);
- under FSDP2 (ZeRO-3) with tensorwise scaling, torchao's `enable_fsdp_float8_all_gather` gathers
  the layers' weights in fp8: half the bytes.

torchao's casts are separate elementwise kernels in eager mode, slower than the GEMM time they
save: its gain is charged only with `compile` on (torchao's README: "enable torch.compile to
generate fused kernels for float8 scaling and casting"). Compile also fuses the elementwise ops
of every block (norms, activations, residual adds) and launches fewer kernels, for any precision:
the coefficients `compile_elementwise` and `compile_host` are bounded, documented factors, not fitted
per row, and a cluster sets them to 1 where compiling gains nothing (the CPU).
"""

from __future__ import annotations

import numpy as np

from autopar.cost.gemm import layer_gemms
from autopar.knobs import FP8_RECIPES, PRECISIONS, RECOMPUTE_MODES
from autopar.runtime import is_megatron

FP8 = PRECISIONS.index("fp8")
RECIPE_CODES = ("none",) + FP8_RECIPES
# HBM bytes per element of each GEMM operand that torchao's casts move under torch.compile, forward and
# backward: (input, weight, output gradient) x (forward, backward), as torchao's own float8 roofline counts
# them (torchao/testing/training/roofline_utils.py `get_tensor_memory_traffic_ovhd_s`, fusion modelled: an
# input's or output gradient's first read is fused into the op that produced it). Tensorwise: the amax
# pass (a read of the weight; fused for the others) and one kernel that writes the fp8 tensor and its
# transpose. Rowwise: a row's scale cannot serve the transposed operand, so the bf16 tensor is transposed
# (written in bf16) and cast again along the other dimension: more traffic than tensorwise, not less;
# and its backward GEMMs (full-precision accumulation) run torchao's workaround for the slow CUTLASS
# rowwise kernel, cuBLAS's tensorwise GEMM and a rescale of the output (torchao PR #1325; issue #2184:
# "at least one extra triton kernel per GEMM"): a read and a write of the input gradient (the input's
# shape) and of the weight gradient, 4 bytes each, beyond the roofline's 3 + 3 and 3 + 7.
# MXFP8: each dimension cast from bf16 separately (32-element blocks).
CAST_BYTES = {"tensorwise": ((4.0, 0.0), (5.0, 3.0), (0.0, 4.0)),
              "rowwise": ((3.0, 7.0), (3.0, 11.0), (0.0, 6.0)),
              "mxfp8": ((1.0, 3.0), (3.0, 3.0), (0.0, 4.0))}
_CAST_TABLE = np.array([np.zeros((3, 2))] + [CAST_BYTES[r] for r in FP8_RECIPES])  # by RECIPE_CODES
TE_CAST_BYTES = 4.0
# torch.compile (Inductor) fuses chains of pointwise ops into one kernel: of the HBM traffic the
# eager ops make, about half remains (a norm, a residual add and an activation read their input
# once instead of once per op; Ansel et al. ASPLOS'24 report 1.4-2x on training of HF and TIMM models
# mostly from such fusion), and launches fewer, fused kernels: half the host time per block pass (the
# GEMMs remain one launch each): the defaults 0.5 and 0.5 of `Coefficients.compile_elementwise` and
# `compile_host`, bounded in [0.3, 1] and [0.2, 1], not fitted. A device where compile gains nothing
# sets them to 1 in its cluster's coefficients (the `cpu` preset, autopar/cluster/presets.py).
# fp8 over bf16 GEMM rate for a large GEMM, per GPU type: fitted to the NeMo 24.07 H100 rows (1.46 on
# all twelve; 1.44-1.52 leaving each model family out in turn: experiments/nemo_fp8.py --fit;
# docs/hardware.md); bounded to (1, 2]:
# the fp8 peak is twice bf16's, and torchao's H100 microbenchmark reaches 1.39x for a whole float8
# linear (casts included) at M, K, N = 4096, 8192, 16384, "approaching 2x as M, K, N increase".
FP8_GEMM_SPEEDUP = {"H100-SXM5-80GB": 1.46, "H200-SXM5-141GB": 1.46}
DEFAULT_FP8_GEMM_SPEEDUP = 1.46  # GPUs with an fp8 rate but no fit (B200, GB200, L40S): the H100 value


def fp8_gemm_speedup(gpu, c=None) -> float:
    """The large-GEMM fp8 speedup: the coefficients' own where set (the torch runtime's fit to torchao's
    kernels, cost/torch_runtime.py), else the GPU type's (the NeMo fit above)."""
    own = c.fp8_gemm_speedup if c is not None else 0.0
    return own or FP8_GEMM_SPEEDUP.get(gpu.name, DEFAULT_FP8_GEMM_SPEEDUP)


def fp8_time_factor(flops, c, gpu, speedup: float | None = None):
    """fp8 over bf16 time of a GEMM of `flops` FLOPs: `fp8_gemm_speedup` (or `speedup`) for a large one,
    the size curve's half point scaled by the fp8 peak's ratio to bf16's (small GEMMs gain little or lose)."""
    ratio = (gpu.peak_flops.get("fp8") or 2 * gpu.peak_flops["bf16"]) / gpu.peak_flops["bf16"]
    return (flops + c.gemm_half_flops * ratio) / ((speedup or fp8_gemm_speedup(gpu, c)) * (flops + c.gemm_half_flops))


def _linears(profile) -> dict[str, np.ndarray]:
    """Per block kind (embedding, layer kinds, head), per sample: the layers' linear GEMM FLOPs
    (forward) and the elements of their inputs, outputs and weights, each split into what tensor
    parallelism shards (divided by tp later) and what it does not. The head and embedding stay bf16."""
    k = len(profile.layers) + 2
    out = {n: np.zeros(k) for n in ("flops", "inputs_tp", "inputs", "outputs_tp", "outputs", "weights",
                                    "attn_out_tp")}
    for i, blk in enumerate(profile.layers, start=1):
        for j, (m, n, kk, column) in enumerate(layer_gemms(profile.dims, profile.seq_len, blk) or ()):
            if j == 1:  # the output projection reads the attention's output
                out["attn_out_tp"][i] = m * kk
            out["flops"][i] += 2 * m * n * kk  # sharded by tp either way
            out["weights"][i] += n * kk  # sharded by tp
            # a column-parallel GEMM reads the whole input and shards its output; a row-parallel one
            # reads a shard of the input and all-reduces its whole output
            out["inputs" if column else "inputs_tp"][i] += m * kk
            out["outputs_tp" if column else "outputs"][i] += m * n
    return out


def te_saved_credit(workload, g, b: np.ndarray, t: np.ndarray, sp_div: np.ndarray, lin: dict) -> np.ndarray:
    """Activation bytes per micro-batch and block kind that Transformer Engine's fp8 linears save less
    than the bf16 layer of cost/fused.py, shape (G, K). Each linear saves its input's fp8 copy (1 byte
    per element) for the weight gradient: the norms' outputs as the sequence shard under sequence
    parallelism (TE's LayerNormLinear gathers it again in backward), the activation's output, and the
    attention's output, which replaces the bf16 one unless the attention kernel keeps that too (a
    flash kernel saves its output for its own backward, and only selective recompute, which reruns
    the core, drops it: then the fp8 copy is a byte more per element, not one less)."""
    kept = ("flash_attn" in workload.switches) & (np.asarray(g.recompute) != RECOMPUTE_MODES.index("selective"))
    attn_out = b * lin["attn_out_tp"] / t  # credited a byte with the row inputs; where kept, a byte more instead
    return b * (lin["inputs"] / sp_div + lin["inputs_tp"] / t) - np.where(kept[:, None], 2 * attn_out, 0.0)


def _plan_masks(workload, g):
    fp8 = np.asarray(g.precision) == FP8
    compiled = np.asarray(g.compile, dtype=bool)
    megatron = is_megatron(workload.runtime)
    gains = fp8 & (compiled | megatron)  # Transformer Engine's fused casts need no compiler
    return fp8, compiled, gains


def compute_scale(workload, g, b: np.ndarray, sp_div: np.ndarray, flops_f: np.ndarray, c) -> dict[str, np.ndarray]:
    """For `_pipeline` (shapes (G, K); `b`, (G, 1), the samples' worth of tokens a rank runs per
    micro-batch; `sp_div`, (G, 1), what sequence parallelism divides the stream by): `gemm`, the
    factor on each kind's FLOPs time (1 but for fp8's linear GEMMs); `cast_f`, `cast_b`, seconds of
    fp8 casts per micro-batch; `elementwise`, the factor on the elementwise traffic (compile);
    `saved`, activation bytes per micro-batch that Transformer Engine saves in fp8 instead of bf16
    (to subtract); `weights`, each kind's layer-linear parameters on a rank (what fp8 casts)."""
    profile, gpu = workload.profile, workload.cluster.gpu
    lin = _linears(profile)
    fp8, compiled, gains = _plan_masks(workload, g)
    col = lambda a: np.asarray(a, dtype=float)[:, None]  # noqa: E731
    t = col(g.tp)
    ones = np.ones_like(flops_f)

    share = np.minimum(np.divide(b * lin["flops"] / t, flops_f, out=np.zeros_like(flops_f), where=flops_f > 0), 1.0)
    # torchao's rowwise recipe runs its own GEMM kernel (CUTLASS), at `fp8_rowwise_speedup` where fitted
    recipe = np.asarray(g.fp8_recipe)
    rowwise = col(recipe == RECIPE_CODES.index("rowwise")) > 0
    factor = fp8_time_factor(flops_f, c, gpu)
    if c.fp8_rowwise_speedup:
        factor = np.where(rowwise, fp8_time_factor(flops_f, c, gpu, c.fp8_rowwise_speedup), factor)
    gemm = np.where(col(gains) > 0, 1 - share * (1 - factor), ones)

    megatron = is_megatron(workload.runtime)
    outputs = b * (lin["outputs"] + lin["outputs_tp"] / t)
    weights = lin["weights"] / t * ones
    hbm = gpu.hbm_bytes_per_s * c.hbm_efficiency
    if megatron:  # inputs forward, output gradients backward; weights cast once per iteration (cached)
        inputs = b * (lin["inputs"] + lin["inputs_tp"] / t)
        cast_f, cast_b = TE_CAST_BYTES * inputs / hbm, TE_CAST_BYTES * outputs / hbm
    else:
        # a column-parallel GEMM's input is cast whole after the gather, but on its sequence shard before an
        # fp8 gather under torchtitan's tensorwise float8 TP (`float8_tp_gathers`)
        eager = np.where(col(compiled) > 0, 1.0, 1 / c.compile_elementwise)
        cast_in = b * (lin["inputs"] / np.where(float8_tp_gathers(workload, g), sp_div, 1.0) + lin["inputs_tp"] / t)
        (in_f, in_b), (w_f, w_b), (_, grad_b) = np.moveaxis(_CAST_TABLE[recipe], 0, -1)[..., None]  # each (G, 1)
        cast_f = eager * (in_f * cast_in + w_f * weights) / hbm
        cast_b = eager * (in_b * cast_in + w_b * weights + grad_b * outputs) / hbm
    on = col(fp8) > 0
    saved = np.where(on & megatron, te_saved_credit(workload, g, b, t, sp_div, lin), 0.0)
    elementwise = np.where(col(compiled) > 0, c.compile_elementwise, 1.0) * ones
    return {"gemm": gemm, "cast_f": np.where(on, cast_f, 0.0), "cast_b": np.where(on, cast_b, 0.0),
            "elementwise": elementwise, "saved": saved, "weights": weights}


def host_scale(g, c) -> np.ndarray:
    """Factor on the host's launch time per block pass, shape (G, 1): compiled blocks launch fewer kernels."""
    return np.where(np.asarray(g.compile, dtype=bool), c.compile_host, 1.0)[:, None]


def fp8_weight_bytes(workload, pa, linear_params: np.ndarray) -> np.ndarray:
    """Bytes of the fp8 weight copies Transformer Engine keeps for the iteration: 1 per layer-linear
    parameter on the rank (`linear_params`, per representative rank; not the embedding's or the
    head's); torchao casts per GEMM (transient)."""
    if not is_megatron(workload.runtime):
        return np.zeros_like(linear_params)
    fp8 = (np.asarray(pa.precision) == FP8)[:, None]
    return np.where(fp8, 1.0 * linear_params, 0.0)


def gather_scale(workload, pa) -> np.ndarray:
    """Factor on the bytes FSDP2 all-gathers, shape (N, 1): torchao's fp8 all-gather sends the layers'
    linear weights in fp8 (tensorwise scaling, ZeRO-3) instead of bf16."""
    if is_megatron(workload.runtime):  # Megatron's ZeRO-3 is torch's FSDP2 without torchao's fp8 weights
        return np.ones((len(pa), 1))
    tensorwise = RECIPE_CODES.index("tensorwise")
    on = ((np.asarray(pa.precision) == FP8) & (np.asarray(pa.fp8_recipe) == tensorwise)
          & (np.asarray(pa.zero) == 3))[:, None]
    return np.where(on, 1 - 0.5 * _linear_param_share(workload.profile), 1.0)


def float8_tp_gathers(workload, g) -> np.ndarray:
    """Which plans gather their regions' inputs in fp8, shape (G, 1): tensorwise fp8 under sequence-parallel
    tp with the `float8_tp` switch (torchtitan's TP plan for tensorwise float8: torchao's
    `PrepareFloat8ModuleInput` and `Float8ColwiseParallel` cast a region's input on its sequence shard
    and all-gather fp8; "float8 all-gather with TP is only supported for tensorwise"). autopar's executor
    applies torch's own parallel styles, which gather bf16, and Transformer Engine's TP gathers bf16 under
    the Megatron flags autopar prices: no switch, no fp8 gather."""
    on = ("float8_tp" in workload.switches) & (np.asarray(g.precision) == FP8) \
        & (np.asarray(g.fp8_recipe) == RECIPE_CODES.index("tensorwise")) & np.asarray(g.sequence_parallel, dtype=bool)
    return on[:, None]


def tp_forward_scale(workload, g) -> np.ndarray:
    """Factor on a transformer layer's forward tensor-parallel bytes, shape (G, 1): where a plan gathers
    fp8 (`float8_tp_gathers`), of the forward's all-gather and reduce-scatter (priced together as one
    all-reduce of the bytes, cost/tensor_parallel.py) the gather moves half: 0.75."""
    return np.where(float8_tp_gathers(workload, g), 0.75, 1.0)


def _linear_param_share(profile) -> float:
    """Share of the model's parameters in the layers' linear GEMMs (what fp8 casts)."""
    lin = _linears(profile)
    counts = np.array([0] + [blk.count for blk in profile.layers] + [0], dtype=float)
    return float(min((lin["weights"] * counts).sum() / max(profile.params, 1), 1.0))
