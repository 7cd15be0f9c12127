"""The few efficiency coefficients of the analytic cost model.

Everything else in the cost model is a datasheet figure (peak FLOP/s, link rate, memory) or a
measured model figure (the profile). These coefficients say how much of the datasheet a real
run reaches. They come in three layers, later ones winning:

1. the dataclass defaults: generic values (an earlier fit to A100 rows), all a GPU without
   public measurements gets; such a GPU is *uncalibrated* and estimates say so;
2. `GPU_CALIBRATION`, per GPU type: at most four coefficients fitted to that GPU's published
   training rows (`experiments/cost_vs_published.py --fit`), each inside `FITTED_BOUNDS` and the
   GEMM efficiency below the GPU's measured maximum achievable matmul FLOP/s (docs/hardware.md);
   a GPU of the same architecture without rows of its own derives them from a fitted one
   (`derive`), scaling only by measured figures;
3. the cluster's own `coefficients` (a preset's measured link efficiencies, or what
   `autopar calibrate` fitted to traces from that cluster): a link efficiency belongs to the
   cluster it was measured on and is never moved to another.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields

from autopar.cluster.gpus import GPUS, match_gpu
from autopar.cost import torch_runtime
from autopar.errors import ClusterError
from autopar.schema import Map, Num, Obj, check, dataclass_schema

# nvlink and ib fitted (see below); the others are typical nccl-tests bus-bandwidth fractions
DEFAULT_LINK_EFFICIENCY = {"nvlink": 0.91, "ib": 1.0, "pcie": 0.75, "upi": 0.6, "ethernet": 0.7, "shm": 1.0,
                           "none": 1.0}


@dataclass(frozen=True)
class Coefficients:
    gemm_efficiency: float = 0.82  # fraction of peak FLOP/s a large GEMM reaches
    gemm_half_flops: float = 1.2e11  # FLOPs of a block's forward on one GPU at which efficiency halves
    hbm_efficiency: float = 0.8  # fraction of HBM bandwidth streaming kernels (optimizer, elementwise) reach
    elementwise_traffic: float = 0.67  # HBM bytes moved per profiled byte of unfused elementwise ops
    # (the profile sums inputs and outputs of every aten op; fused kernels keep most in registers)
    link_efficiency: dict = field(default_factory=lambda: dict(DEFAULT_LINK_EFFICIENCY))
    latency_scale: float = 1.0  # multiplies the per-hop latency of collectives
    dp_overlap: float = 0.16  # fraction of backward compute that hides data-parallel communication
    # (Megatron-LM 2021 reduced gradients after the backward pass; calibrate for torch DDP's overlap)
    optimizer_bytes_per_param: float = 32.0  # Adam: fp32 param, grad, two moments read and written
    host_bytes_per_s: float = 40e9  # CPU memory bandwidth for an offloaded optimizer step
    host_link_bytes_per_s: float = 20e9  # PCIe between GPU and host for offload traffic
    workspace_bytes: float = 1.0e9  # allocator workspace, kernels' scratch, fragmentation
    step_overhead_s: float = 0.0  # fixed per-iteration cost (launch, Python, data loading)
    # Fixed costs that dominate small runs (0 by default: Megatron-scale runs do not see them;
    # calibration fits them, e.g. to vTrain's single-node A100 runs):
    collective_latency_s: float = 0.0  # per collective call (launch, rendezvous): NCCL's base latency
    block_host_s: float = 0.0  # host seconds per layer per pass (kernel launches, Python); another block
    # pays its launches over a layer's (cost/launches.py); backward is two passes, recompute one. A
    # micro-batch on a rank takes the host_overlap-norm of host and GPU time:
    host_overlap: float = 4.0  # 1: host and GPU work add up; large: the larger of the two (fully hidden)
    tp_host_s: float = 0.0  # extra host seconds per layer per pass when tp > 1: DTensor's dispatch
    # (sharding propagation and redistribution run in Python for every op of a tensor-parallel block)
    selective_host_s: float = 0.0  # extra host seconds per block per micro-batch under selective recompute:
    # PyTorch's selective checkpoint caches every kept op's output and replays the block in Python
    launch_s: float = 0.0  # host seconds per kernel launch, times a layer's launches (cost/launches.py
    # `layer_launches`) on top of block_host_s; `for_cluster` sets it from the GPU's generation (LAUNCH_S)
    # torch.compile of each block: factors on a compiled block's elementwise HBM traffic (Inductor fuses
    # pointwise chains) and on its host launch time (cost/precision.py says where 0.5 comes from); 1 and 1:
    # compile gains nothing on this device (the cpu preset)
    compile_elementwise: float = 0.5
    compile_host: float = 0.5
    # fp8 over bf16 rate of a large GEMM; 0: the GPU type's (cost/precision.py, the NeMo fit); rowwise 0:
    # the same as tensorwise. Set per GPU type for the torch runtime by cost/torch_runtime.py (torchao's kernels)
    fp8_gemm_speedup: float = 0.0
    fp8_rowwise_speedup: float = 0.0
    async_tp_overlap: float = 1.0  # share of a pass's GEMM time under which torch's async TP hides its collectives
    # bandwidth of ZeRO's collectives relative to the all-reduce's (reduce_scatter, all_gather: FSDP;
    # broadcast: ZeroRedundancyOptimizer's shards), measured by `autopar profile-cluster`; 1 if absent
    collective_efficiency: dict = field(default_factory=dict)

    @property
    def host(self) -> bool:
        """Whether the host's launch time is modelled at all."""
        return self.block_host_s > 0 or self.tp_host_s > 0 or self.selective_host_s > 0 or self.launch_s > 0

    def link(self, kind: str) -> float:
        return self.link_efficiency.get(kind, 1.0)

    def collective(self, name: str) -> float:
        return self.collective_efficiency.get(name, 1.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_cluster(cls, cluster, runtime: str = "megatron") -> Coefficients:
        """The coefficients the cost model uses on `cluster` under `runtime`: layers 1-3 of the module
        doc. A GPU type's fit describes its hardware (GEMM rates) and the fitting rows' software
        (kernel fusion); under another runtime the software part does not carry: torch runs a model
        file's elementwise ops eagerly, each reading its inputs and writing its output through HBM,
        which is what the profile counts (elementwise_traffic 1)."""
        cal = gpu_calibration(cluster.gpu.name)
        fitted = dict(cal.fitted)
        if cal.regime and runtime not in cal.regime["runtime"]:
            fitted["elementwise_traffic"] = EAGER_ELEMENTWISE_TRAFFIC
        if runtime == "torch":  # the torch runtime's own fit to torch-native rows, where its GPU type has one
            fitted.update(torch_runtime.fitted(cluster.gpu.name))
        if not HOST_COEFFICIENTS & set(cluster.coefficients):  # a calibrated host time replaces the default
            fitted["launch_s"] = launch_s(cluster.gpu.name)
        return cls.from_dict({**fitted, **cluster.coefficients})

    @classmethod
    def from_dict(cls, d: dict | None) -> Coefficients:
        """Checked against `coefficients_schema` (the cluster JSON's `coefficients` is opaque to the
        cluster loader: the cost model owns these names)."""
        if not d:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ClusterError(f"unknown cost coefficient(s) {unknown} in cluster JSON; valid: {sorted(known)}")
        d = check(d, coefficients_schema(), "coefficients", ClusterError)
        if "link_efficiency" in d:
            d["link_efficiency"] = {**DEFAULT_LINK_EFFICIENCY, **d["link_efficiency"]}
        return cls(**d)



COEFFICIENT_RANGES = {
    "host_overlap": Num(1.0, 1e3),  # the norm's exponent: 1 adds host and GPU time, large takes the max
    "dp_overlap": Num(0.0, 1.0),
    "gemm_efficiency": Num(0.0, 1.0, open_lo=True),
    "hbm_efficiency": Num(0.0, 1.0, open_lo=True),
    "compile_elementwise": Num(0.3, 1.0),  # compiled kernels move at most the eager traffic
    "compile_host": Num(0.2, 1.0),
    "fp8_gemm_speedup": Num(0.0, 2.0),  # 0: the GPU type's; else at most the fp8 peak's 2x
    "fp8_rowwise_speedup": Num(0.0, 2.0),
    "async_tp_overlap": Num(0.0, 1.0),
    "launch_s": Num(0.0, 1e-3),  # a kernel launch takes microseconds, never a millisecond
}
LINK_EFFICIENCY_KEYS = ("nvlink", "pcie", "upi", "ib", "ethernet", "shm", "none")
COLLECTIVES = ("reduce_scatter", "all_gather", "broadcast")


@functools.cache  # every estimate reads its cluster's coefficients through it: derive the schema once
def coefficients_schema() -> Obj:
    """The `coefficients` of a cluster JSON, derived from the dataclass's fields."""
    return dataclass_schema(Coefficients, {
        **COEFFICIENT_RANGES,
        "link_efficiency": Map(Num(0.0, 10.0, open_lo=True), LINK_EFFICIENCY_KEYS),
        "collective_efficiency": Map(Num(0.0, 10.0, open_lo=True), COLLECTIVES),
    })

# Bounds of the coefficients fitted per GPU type: physical ranges (an efficiency never above 1, a GEMM
# never above its measured maximum, see GpuCalibration.gemm_ceiling). link_efficiency.ib is fitted to
# the same rows but stored on the cluster preset the rows ran on (`selene`, autopar/cluster/presets.py).
FITTED_BOUNDS = {
    "gemm_efficiency": (0.3, 1.0),  # fraction of peak a large GEMM reaches in training (<= gemm_ceiling)
    "gemm_half_flops": (1e9, 1e13),  # per-GPU FLOPs of a block's forward at which GEMM efficiency halves
    "elementwise_traffic": (0.2, 2.0),  # HBM bytes per profiled elementwise byte (kernel fusion)
    "link_efficiency.ib": (0.5, 1.0),  # fraction of the NICs' rate NCCL reaches across nodes
}
MAX_FITTED = 4
EAGER_ELEMENTWISE_TRAFFIC = 1.0  # HBM bytes per profiled byte when every elementwise op is its own kernel


@dataclass(frozen=True)
class GpuCalibration:
    """What the cost model knows of one GPU type beyond its datasheet (docs/hardware.md).

    gemm_ceiling: maximum achievable matmul FLOP/s over datasheet peak, bf16, measured (MAMF);
    fitted: coefficients fitted to published training rows on this GPU (or derived, see `derive`);
    regime: what those rows covered (precisions, recompute modes, runtimes, largest tp, pp, dp);
    source: where the rows and the ceiling come from."""

    gemm_ceiling: float | None = None
    fitted: dict = field(default_factory=dict)
    regime: dict = field(default_factory=dict)
    source: str = ""
    derived_from: str = ""  # the GPU whose fit this one's coefficients were scaled from (see `derive`)
    # (the best MFU published on each GPU type, with its source: autopar/cost/published_mfu.py)

    @property
    def calibrated(self) -> bool:
        return bool(self.fitted)

    def upper_bound(self, name: str, hi: float) -> float:
        """`hi` for coefficient `name`, lowered to the measured GEMM ceiling for gemm_efficiency: no
        GEMM on this GPU beats it (the shipped fits and `autopar calibrate` both keep to it)."""
        return min(hi, self.gemm_ceiling) if name == "gemm_efficiency" and self.gemm_ceiling else hi

    def __post_init__(self):
        if len(self.fitted) > MAX_FITTED:
            raise ValueError(f"at most {MAX_FITTED} fitted coefficients per GPU type, got {sorted(self.fitted)}")
        for name, value in self.fitted.items():
            lo, hi = FITTED_BOUNDS[name]
            hi = self.upper_bound(name, hi)
            if not lo <= value <= hi:
                raise ValueError(f"{name} = {value} outside its physical range [{lo}, {hi}]")


def derive(base_name: str, base: GpuCalibration, base_peak: float, peak: float, gemm_ceiling: float) -> GpuCalibration:
    """A same-lineage GPU's calibration from a fitted one, scaled only by measured figures: the GEMM
    efficiency keeps its share of the measured ceiling; the half point scales with peak FLOP/s (a
    faster GPU needs proportionally more work per kernel to fill its SMs); software fusion (elementwise
    traffic) carries over. Its regime is the base's: nothing on this GPU was fitted."""
    fitted = {k: v for k, v in base.fitted.items() if k in ("elementwise_traffic",)}
    fitted["gemm_efficiency"] = base.fitted["gemm_efficiency"] * gemm_ceiling / base.gemm_ceiling
    fitted["gemm_half_flops"] = base.fitted["gemm_half_flops"] * peak / base_peak
    return GpuCalibration(gemm_ceiling, fitted, base.regime, base.source, derived_from=base_name)


_MEGATRON_A100 = "Megatron-LM SC'21 Table 1 + Korthikanti et al. 2022 Table 5 (DGX A100 80GB)"
_A100 = GpuCalibration(
    gemm_ceiling=267.9 / 312,  # MAMF, A100 SXM, bf16 (ml-engineering, docs/hardware.md)
    # experiments/cost_vs_published.py --fit (with link_efficiency.ib = 0.5, kept on the selene preset);
    # the GEMMs' tile and wave quantisation (autopar/cost/gemm.py) is priced before the size curve.
    # The IB efficiency ends on its lower bound (docs/hardware.md says why)
    fitted={"gemm_efficiency": 0.7959, "gemm_half_flops": 1.998e10, "elementwise_traffic": 0.8909},
    regime={"precision": ("bf16", "fp16"), "recompute": ("full", "selective"), "runtime": ("megatron",),
            "tp": 8, "pp": 64, "dp": 32},
    source=_MEGATRON_A100)
GPU_CALIBRATION: dict[str, GpuCalibration] = {
    "A100-SXM4-80GB": _A100,
    "A100-SXM4-40GB": _A100,  # the same chip, less and slower HBM (the datasheet figures differ)
    # MAMF (docs/hardware.md): H100 SXM 792.1, H100/H200 SXM 794.5, B200 1745 of 2250 TFLOP/s; GB200 has
    # the B200's die at a higher power limit: its ceiling fraction is taken as the B200's
    "H100-SXM5-80GB": derive("A100", _A100, 312e12, 989e12, 792.1 / 989),
    "H200-SXM5-141GB": derive("A100", _A100, 312e12, 989e12, 794.5 / 989),
    "B200": derive("A100", _A100, 312e12, 2250e12, 1745.0 / 2250),
    # power-limited parts (autopar/cluster/gpus.py): no MAMF was published at their limits, so each keeps
    # its full-power part's ceiling as a fraction of its own (power-scaled) peak
    "H100-SXM-96GB-HBM2e-500W": derive("A100", _A100, 312e12, GPUS["h100-gt"].peak_flops["bf16"], 792.1 / 989),
    "B200-750W": derive("A100", _A100, 312e12, GPUS["b200-750w"].peak_flops["bf16"], 1745.0 / 2250),
    "GB200": derive("A100", _A100, 312e12, 2500e12, 1745.0 / 2250),
}
UNCALIBRATED = GpuCalibration()


def gpu_calibration(gpu_name: str) -> GpuCalibration:
    """The calibration of a GPU by its spec name; UNCALIBRATED for GPUs without public measurements."""
    return GPU_CALIBRATION.get(gpu_name, UNCALIBRATED)


# Host time per kernel launch without calibration, by the GPU's generation (docs/hardware.md "Host time";
# docs/references.md §14). It is the host's cost (Python, the dispatcher, the driver's cudaLaunchKernel)
# of one operator that runs one kernel, measured on each generation's servers; Megatron-Core's layer
# goes through the same Python-to-C++ path per kernel, so both runtimes take it (they differ in how
# many kernels a layer launches, `cost/launches.py`). A GPU without a measured generation (V100, Ada's
# L40S and RTX 4090, the cpu preset: ops there run inline, their time is in its rates) gets 0.
LAUNCH_S = {
    "ampere": 4.0e-6,  # A100: ~4 us per eager op on CUDA (pytorch/pytorch#82793, PyTorch 1.12)
    "hopper": 9.4e-6,  # DGX H100: torch eager 0.616 ms of CPU time for 65 kernels (NVIDIA/Fuser#3507)
    # GB200: Inductor's per-kernel launch path 6.8 us (meta-pytorch/tritonbench#1017), what torch.compile's
    # costs per kernel on DGX H100 (NVIDIA/Fuser#3507): the host path costs the same, so eager as Hopper's
    "blackwell": 9.4e-6,
}
GENERATION = {"a100-40g": "ampere", "a100-80g": "ampere", "h100": "hopper", "h200": "hopper", "h100-gt": "hopper",
              "b200": "blackwell", "b200-750w": "blackwell", "gb200": "blackwell"}
HOST_COEFFICIENTS = frozenset({"block_host_s", "tp_host_s", "selective_host_s", "launch_s"})


def launch_s(gpu_name: str) -> float:
    """The default host seconds per kernel launch on a GPU (by spec or device name), 0 where unmeasured."""
    key = next((k for k, spec in GPUS.items() if spec.name == gpu_name), None) or match_gpu(gpu_name, 80e9)
    return LAUNCH_S.get(GENERATION.get(key, ""), 0.0)
