"""Accelerator specs: the datasheet figures the cost model divides work by.

Figures are dense (no sparsity), per device, from the vendors' datasheets (docs/references.md §4).
Bandwidths are bytes/s; FLOP/s are per dtype of the matmul inputs with fp32 accumulation.
Memory is what CUDA reports as the device's total (torch.cuda.get_device_properties().total_memory,
the "total capacity" of torch's out-of-memory message), not the datasheet's "80GB": HBM sizes are
binary (an H100 80GB reports 79.11 GiB = 84.9e9 bytes), less what the driver reserves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("bf16", "fp16", "fp32")
OPTIONAL_DTYPES = ("fp8", "mxfp8")  # only GPUs with such tensor cores list them


@dataclass(frozen=True)
class GPUSpec:
    name: str
    # dense FLOP/s per dtype: "bf16", "fp16", "fp32"; "fp8" only where the GPU has fp8 tensor cores,
    # "mxfp8" where they also take block-scaled (MX) inputs (Blackwell)
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: float  # device memory, bytes, as CUDA reports it (total_memory)
    hbm_bytes_per_s: float  # device-memory bandwidth, bytes/s
    sms: int = 0  # streaming multiprocessors: GEMM tiles run in waves of one per SM (0: not modelled)

    def to_dict(self) -> dict:
        d = {"name": self.name, "peak_flops": dict(self.peak_flops),
             "memory_bytes": self.memory_bytes, "hbm_bytes_per_s": self.hbm_bytes_per_s}
        return {**d, "sms": self.sms} if self.sms else d


GIB = 2**30


def _spec(name: str, half: float, fp32: float, memory_gib: float, hbm_gb_s: float, bf16: float | None = None,
          sms: int = 0, fp8: float | None = None, mxfp8: bool = False) -> GPUSpec:
    flops = {"bf16": half if bf16 is None else bf16, "fp16": half, "fp32": fp32}
    if fp8:
        flops["fp8"] = fp8
        if mxfp8:  # MXFP8 runs at the fp8 rate on Blackwell's tensor cores
            flops["mxfp8"] = fp8
    return GPUSpec(name, flops, memory_gib * GIB, hbm_gb_s * 1e9, sms)


def _by_power(watts: float, low_watts: float, high_watts: float, low: float, high: float) -> float:
    """A rate at a power limit between two datasheet parts of one die (`low` at `low_watts`, `high` at
    `high_watts`), linear in the limit: what a power-capped part sustains is set by its clock, which the
    limit sets; no published figure gives the curve between, so it is drawn straight."""
    return low + (high - low) * (watts - low_watts) / (high_watts - low_watts)


# V100 has no bf16 tensor cores: bf16 matmuls run at the fp32 rate at best. SM counts from the
# architecture whitepapers (A100 108, H100 SXM5 132, B200 148 per GPU: 2 dies x 74).
# Memory (GiB) as CUDA reports it, from published device queries and torch OOM messages
# (docs/hardware.md "GPU memory" lists each source); GB200 and the 96 GB H100 are estimates, said there.
GPUS: dict[str, GPUSpec] = {
    "v100-32g": _spec("V100-SXM2-32GB", 125e12, 15.7e12, 31.74, 900, bf16=15.7e12, sms=80),
    "a100-40g": _spec("A100-SXM4-40GB", 312e12, 19.5e12, 42_298_834_944 / GIB, 1555, sms=108),
    "a100-80g": _spec("A100-SXM4-80GB", 312e12, 19.5e12, 79.25, 2039, sms=108),
    # fp8: dense, half the datasheets' "with sparsity" figures (H100/H200 SXM 3,958 TFLOP/s; B200 9 PFLOP/s;
    # GB200 NVL72 720 PFLOP/s over 72 GPUs); A100, V100 and the CPU have no fp8 tensor cores (absent)
    "h100": _spec("H100-SXM5-80GB", 989e12, 67e12, 79.11, 3350, sms=132, fp8=1979e12),
    "h200": _spec("H200-SXM5-141GB", 989e12, 67e12, 139.80, 4800, sms=132, fp8=1979e12),
    # Meta's Grand Teton H100 (torchtitan's published H100 runs): the SXM part with 96 GB of HBM2e at
    # 2.4 TB/s and a 500 W power limit. Its rates lie between the H100 NVL's (400 W) and the H100 SXM's
    # (700 W) datasheets, as torchtitan's benchmark says; taken linearly in the power limit
    # (docs/hardware.md). Memory as CUDA reports a 96 GB Hopper (an estimate, docs/hardware.md).
    "h100-gt": _spec("H100-SXM-96GB-HBM2e-500W", *(_by_power(500, 400, 700, nvl, sxm) for nvl, sxm in
                                                  ((835e12, 989e12), (60e12, 67e12))),
                     95.08, 2400, sms=132, fp8=_by_power(500, 400, 700, 1670e12, 1979e12)),
    # Blackwell (docs/hardware.md): B200 as in DGX B200 (64 TB/s HBM3e over 8 GPUs; 2.25 PFLOP/s
    # dense bf16, 75 TFLOP/s fp32); GB200 as in GB200 NVL72 (576 TB/s HBM3e, 180 PFLOP/s dense bf16,
    # 5,760 TFLOP/s fp32 over 72 GPUs)
    "b200": _spec("B200", 2250e12, 75e12, 178.35, 8000, sms=148, fp8=4500e12, mxfp8=True),
    # B200 at a 750 W power limit (torchao's "power limited B200" MXFP8 rows): between the HGX B100's
    # (700 W) and the HGX B200's (1000 W) datasheet tensor rates, the same die, HBM3e at 8 TB/s in both;
    # fp32 (not on the B100's datasheet) at the bf16 rate's share of the B200's
    "b200-750w": _spec("B200-750W", _by_power(750, 700, 1000, 1750e12, 2250e12),
                       75e12 * _by_power(750, 700, 1000, 1750e12, 2250e12) / 2250e12, 178.35, 8000, sms=148,
                       fp8=_by_power(750, 700, 1000, 3500e12, 4500e12), mxfp8=True),
    "gb200": _spec("GB200", 2500e12, 80e12, 184.3, 8000, sms=148, fp8=5000e12, mxfp8=True),
    "l40s": _spec("L40S", 362e12, 91.6e12, 44.42, 864, sms=142),
    # GeForce: 165 TFLOP/s is the fp32-accumulate rate (330 with fp16 accumulation).
    "rtx4090": _spec("RTX-4090", 165e12, 82.6e12, 23.64, 1008, sms=128),
    # One gloo worker process on a CPU core: nominal figures for planning local test runs;
    # calibration replaces them with measured ones. Memory is a per-process share of host RAM.
    "cpu": _spec("cpu-process", 50e9, 50e9, 8e9 / GIB, 10),
}

# Substrings of torch.cuda.get_device_name() -> GPUS key; the first match wins, so more
# specific patterns come first.
_NAME_PATTERNS = (("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100-"),
                  ("v100", "v100-32g"), ("l40s", "l40s"), ("4090", "rtx4090"))


def match_gpu(device_name: str, memory_bytes: float) -> str | None:
    """The GPUS key for a CUDA device name (memory tells an A100 40GB from an 80GB), or None."""
    lowered = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if pattern in lowered:
            return ("a100-80g" if memory_bytes > 50e9 else "a100-40g") if key == "a100-" else key
    return None


# Dense tensor-core fp16/bf16 and CUDA-core fp32 FLOPs per SM per clock, by compute capability
# (datasheet peak / (SMs x boost clock)); a newer architecture uses its nearest predecessor.
_FLOPS_PER_SM_CLOCK = {(7, 0): (1024, 128), (8, 0): (2048, 128), (8, 6): (1024, 256),
                       (9, 0): (4096, 256), (10, 0): (8192, 256)}
_NOMINAL_CLOCK_HZ = 1.5e9  # when the driver reports no clock rate
_NOMINAL_HBM_BYTES_PER_S = 1e12  # when it reports no memory clock


def derive_gpu(props) -> GPUSpec:
    """A spec computed from torch.cuda device properties, for GPUs not in GPUS."""
    arch = max((cc for cc in _FLOPS_PER_SM_CLOCK if cc <= (props.major, props.minor)), default=(7, 0))
    half, fp32 = _FLOPS_PER_SM_CLOCK[arch]
    clock = props.clock_rate * 1e3 or _NOMINAL_CLOCK_HZ  # clock_rate is in kHz
    sms = props.multi_processor_count
    bf16 = half if arch >= (8, 0) else fp32  # no bf16 tensor cores before Ampere
    # Double data rate: two transfers per memory clock over the bus width (bits).
    hbm = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8 or _NOMINAL_HBM_BYTES_PER_S
    return GPUSpec(props.name, {"bf16": sms * clock * bf16, "fp16": sms * clock * half, "fp32": sms * clock * fp32},
                   float(props.total_memory), hbm, sms)
