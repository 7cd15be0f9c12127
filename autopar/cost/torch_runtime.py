"""The torch runtime's coefficients per GPU type, fitted to PyTorch-native training rows.

The GPU types' fits (cost/coefficients.py `GPU_CALIBRATION`) come from Megatron-LM and NeMo runs:
Transformer Engine's fp8 GEMMs, Megatron's fused kernels. autopar's executor, torchtitan and torchao
run other kernels: cuBLAS through eager aten ops or Inductor's fused graphs, torchao's float8 casts
and GEMMs (cuBLAS tensorwise, CUTLASS rowwise), SDPA's flash kernel. What those reach on a GPU type
is fitted here, at most four coefficients per type, each inside `BOUNDS`, to the rows of
`data/published/torch_native_shared.csv` on that type only (torchtitan's Grand Teton H100 tables,
torchao's float8 H100 rows, torchao's MXFP8 B200 rows) by `experiments/fit_torch_runtime.py`
(`autopar/calibrate/torch_runtime.py`), which also validates them held out (docs/hardware.md, "The
torch runtime on torch-native rows"). `Coefficients.for_cluster` applies them under runtime torch
only; a cluster's own coefficients (`autopar calibrate`) still win. A GPU type without rows keeps
the Megatron-derived values.

What is structural, not fitted (cost/model.py, cost/op_sac.py, cost/precision.py): torchtitan's per-op
selective checkpoint (`op_sac`), async TP's micro-pipelined collectives (`async_tp`, how much of the
GEMMs hides them fitted), FSDP2's gathers and reduce-scatters at the links' rates and its prefetch
under `dp_overlap` of the passes, torchao's casts at HBM bandwidth, compile's documented factors.
"""

from __future__ import annotations

# the coefficients the fit may move, and their physical ranges: a GEMM's share of peak (below the
# GPU's measured MAMF ceiling, GpuCalibration.upper_bound), what of the eager elementwise traffic a
# compiled block still moves, the fp8 GEMM rate over bf16's (the fp8 peak is twice bf16's: at most 2),
# and torchao's rowwise GEMM rate over bf16's (its CUTLASS kernel; torchtitan issue 1207 reports
# rowwise runs slower than bf16 ones, so it may sit below 1)
BOUNDS = {
    "gemm_efficiency": (0.3, 1.0),
    "compile_elementwise": (0.3, 1.0),
    "fp8_gemm_speedup": (1.0, 2.0),
    "fp8_rowwise_speedup": (0.7, 2.0),
    "async_tp_overlap": (0.0, 1.0),  # share of a pass's GEMM time async TP's collectives hide under
}
MAX_FITTED = 4

# experiments/fit_torch_runtime.py, each GPU type fitted to all its rows of data/published/torch_native_shared.csv
# (CSV line numbers; the script prints each row held out). Values as it printed them on 2026-12-07.
TORCH_RUNTIME: dict[str, dict[str, float]] = {
    # grand-teton-h100: torchtitan Tables 1, 3, 4, 5 (1F1B), its async-TP table and torchao's float8 table
    # (lines 2-10, 12-26)
    "H100-SXM-96GB-HBM2e-500W": {
        "gemm_efficiency": 0.6199,  # all 24 rows
        "fp8_gemm_speedup": 1.7363,  # the tensorwise rows, lines 4, 7-10, 14, 15, 20, 21, 25
        "fp8_rowwise_speedup": 1.0767,  # the rowwise rows, lines 16, 17, 22, 23, 26
        "async_tp_overlap": 0.0596,  # the async-TP rows beside their twins, lines 9, 10, 13, 15, 17, 19, 21, 23
    },
    # dgx-b200-750w: torchao's MXFP8 table, lines 27-29 (tensorwise and MXFP8 share the fp8 speedup)
    "B200-750W": {"gemm_efficiency": 0.3395, "fp8_gemm_speedup": 1.479},
}


def fitted(gpu_name: str) -> dict[str, float]:
    """The torch runtime's fitted coefficients of a GPU type (by spec name); {} where none were fitted."""
    return dict(TORCH_RUNTIME.get(gpu_name, {}))


def check(values: dict[str, float]) -> None:
    """At most MAX_FITTED coefficients, each a known one inside its bounds (ValueError otherwise)."""
    if len(values) > MAX_FITTED:
        raise ValueError(f"at most {MAX_FITTED} torch-runtime coefficients per GPU type, got {sorted(values)}")
    for name, value in values.items():
        lo, hi = BOUNDS[name]
        if not lo <= value <= hi:
            raise ValueError(f"{name} = {value} outside [{lo}, {hi}]")


for _values in TORCH_RUNTIME.values():
    check(_values)
