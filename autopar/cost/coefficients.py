"""The few efficiency coefficients of the analytic cost model.

Everything else in the cost model is a datasheet figure (peak FLOP/s, link rate, memory) or a
measured model figure (the profile). These coefficients say how much of the datasheet a real
run reaches; calibration fits them to measured traces and stores them in a cluster JSON under
`coefficients`. The defaults were fitted once to Megatron-LM's published A100 figures
(REFERENCES.md §1-2, see tests/test_cost_published.py) and are used for every preset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from autopar.errors import ClusterError

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
    block_host_s: float = 0.0  # host seconds per block per pass (kernel launches, Python); backward is
    # two passes, recompute one. A micro-batch on a rank takes the host_overlap-norm of host and GPU time:
    host_overlap: float = 4.0  # 1: host and GPU work add up; large: the larger of the two (fully hidden)
    tp_host_s: float = 0.0  # extra host seconds per block per pass when tp > 1: DTensor's dispatch
    # (sharding propagation and redistribution run in Python for every op of a tensor-parallel block)
    selective_host_s: float = 0.0  # extra host seconds per block per micro-batch under selective recompute:
    # PyTorch's selective checkpoint caches every kept op's output and replays the block in Python
    # bandwidth of ZeRO's collectives relative to the all-reduce's (reduce_scatter, all_gather: FSDP;
    # broadcast: ZeroRedundancyOptimizer's shards), measured by `autopar profile-cluster`; 1 if absent
    collective_efficiency: dict = field(default_factory=dict)

    @property
    def host(self) -> bool:
        """Whether the host's launch time is modelled at all."""
        return self.block_host_s > 0 or self.tp_host_s > 0 or self.selective_host_s > 0

    def link(self, kind: str) -> float:
        return self.link_efficiency.get(kind, 1.0)

    def collective(self, name: str) -> float:
        return self.collective_efficiency.get(name, 1.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Coefficients:
        if not d:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ClusterError(f"unknown cost coefficient(s) {unknown} in cluster JSON; valid: {sorted(known)}")
        d = dict(d)
        if "link_efficiency" in d:
            d["link_efficiency"] = {**DEFAULT_LINK_EFFICIENCY, **d["link_efficiency"]}
        return cls(**d)
