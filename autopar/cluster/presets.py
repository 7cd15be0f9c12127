"""Common machines, written as cluster JSON documents (the format `load_cluster` reads).

Rates are one-way datasheet figures (docs/references.md §4), not measured throughput: the cost
model's per-kind efficiency (fitted by calibration) turns them into what NCCL reaches.
  nvlink  per GPU to the NVSwitch: NVLink2 150 GB/s (6 x 25), NVLink3 300, NVLink4 450
  pcie    x16 link: Gen3 16 GB/s, Gen4 32, Gen5 64
  upi     one link between CPU sockets: PCIe peer traffic across sockets does not stripe over
          the several links, and NCCL's own topology model rates this path below a PCIe x16
          (topo.h: SKL_QPI_BW 10 vs PCI_BW 12 GB/s), so it is the bottleneck of a PCIe box.
  nvlink  NVLink5 (Blackwell) 900 GB/s per GPU each way
  ib/ethernet  per NIC: 100 Gb/s = 12.5 GB/s, HDR 200 Gb/s = 25, NDR 400 Gb/s = 50.
A "node" is an NVLink domain: GB200 NVL72's 72 GPUs on one NVLink switch fabric are one node, so
every group of up to 72 GPUs rings over NVLink and only larger ones cross the InfiniBand fabric.
Latencies are per edge, typical figures: a GPU-to-GPU hop crosses two edges, so it costs 2 us
over NVLink, 3 us under one PCIe switch, and NIC to NIC 5 us over IB plus the PCIe legs.
"""

from __future__ import annotations

# Measured on DGX A100 (docs/hardware.md): NVLink from nccl-tests all-reduce bus bandwidth on one
# node, 4 GiB (233.9 of 300 GB/s, docs/references.md §3), a property of the node. The InfiniBand
# efficiency was fitted to Megatron-LM's multi-node rows (experiments/cost_vs_published.py --fit),
# measured on NVIDIA's Selene: it belongs to the `selene` preset alone, never to another cluster.
DGX_A100_NVLINK_EFFICIENCY = 0.78
# DGX H100/H200 (NVLink 4, 450 GB/s one way): NCCL's ring collectives reach about 370 GB/s bus bandwidth
# (NCCL maintainer, NVIDIA/nccl-tests issue 212; docs/references.md §3). All-reduce with NVLink SHARP
# reaches about 480 GB/s (475 measured on 8 H200, nccl-tests issue 272), which the ring model does not
# take: Megatron's tensor- and data-parallel collectives are reduce-scatters and all-gathers.
DGX_H100_NVLINK_EFFICIENCY = 370 / 450
SELENE_IB_EFFICIENCY = 0.5
_LATENCY = {"nvlink": 1e-6, "pcie": 1.5e-6, "upi": 1e-6, "ib": 2.5e-6, "ethernet": 5e-6, "shm": 10e-6}


def _preset(gpu: str, gpus_per_node: int, node: dict, **bandwidths: float) -> dict:
    links = {kind: {"bandwidth": bandwidth, "latency": _LATENCY[kind]} for kind, bandwidth in bandwidths.items()}
    return {"gpu": gpu, "nodes": 1, "gpus_per_node": gpus_per_node, "node": node, "links": links}


def _dgx(gpu: str, nics: int, **bandwidths: float) -> dict:
    """Two CPU sockets, PCIe switches each holding 2 GPUs and their NICs, GPUs on NVSwitch."""
    node = {"intra": "nvswitch", "sockets": 2, "gpus_per_pcie_switch": 2, "nics": nics,
            "nic_attach": "switch", "nic_kind": "ib"}
    return _preset(gpu, 8, node, **bandwidths)


def _pcie_box(gpu: str, gpus_per_pcie_switch: int, nic_attach: str, nic_kind: str, **bandwidths: float) -> dict:
    """Two CPU sockets with PCIe switches of GPUs; no NVLink; two NICs."""
    node = {"intra": "pcie", "sockets": 2, "gpus_per_pcie_switch": gpus_per_pcie_switch, "nics": 2,
            "nic_attach": nic_attach, "nic_kind": nic_kind}
    return _preset(gpu, 8, node, **bandwidths)


PRESETS: dict[str, dict] = {
    # DGX-1V's hybrid cube mesh is modelled as a switch giving each GPU its 6 NVLinks
    # (150 GB/s): NCCL's rings over all 8 GPUs use every link, subsets of the mesh would get less.
    # Sockets: Xeon E5 with QPI 9.6 GT/s (19.2 GB/s); 4 x 100 Gb/s EDR IB, one per 2 GPUs.
    "dgx-v100": _dgx("v100-32g", 4, nvlink=150e9, pcie=16e9, upi=19.2e9, ib=12.5e9),
    # Sockets: AMD EPYC joined by xGMI, one x16 link at 16 GT/s; 8 x HDR IB, one per GPU.
    # (the 40 and 80 GB DGX A100 share the NVLink 3 fabric: six NVSwitches, 300 GB/s per GPU each way)
    "dgx-a100-40g": {**_dgx("a100-40g", 8, nvlink=300e9, pcie=32e9, upi=32e9, ib=25e9),
                     "coefficients": {"link_efficiency": {"nvlink": DGX_A100_NVLINK_EFFICIENCY}}},
    "dgx-a100-80g": {**_dgx("a100-80g", 8, nvlink=300e9, pcie=32e9, upi=32e9, ib=25e9),
                     "coefficients": {"link_efficiency": {"nvlink": DGX_A100_NVLINK_EFFICIENCY}}},
    # NVIDIA's Selene (DGX A100 80GB SuperPOD, 8 x HDR per node), where Megatron-LM's published runs
    # (Narayanan et al. SC'21, Korthikanti et al. 2022) were measured, with its fitted IB efficiency
    "selene": {**_dgx("a100-80g", 8, nvlink=300e9, pcie=32e9, upi=32e9, ib=25e9),
               "coefficients": {"link_efficiency": {"nvlink": DGX_A100_NVLINK_EFFICIENCY,
                                                    "ib": SELENE_IB_EFFICIENCY}}},
    # The A100 cluster vTrain's runs were measured on (data/vtrain): DGX A100 nodes, but 800 Gb/s of
    # inter-node bandwidth per node (4 x HDR 200 Gb/s, one per two GPUs), as every one of vTrain's
    # 1,548 validation configurations states it (`"inter_node_bandwidth": 800`, in Gbps per node,
    # VIA-Research/vTrain src/config.py): half of a DGX A100's 8 x HDR compute fabric. A cluster
    # fact from the source, not a fitted efficiency: its IB links keep the datasheet rate.
    "vtrain-a100": {**_dgx("a100-80g", 4, nvlink=300e9, pcie=32e9, upi=32e9, ib=25e9),
                    "coefficients": {"link_efficiency": {"nvlink": DGX_A100_NVLINK_EFFICIENCY}}},
    # Sockets: Xeon with UPI 2.0 at 16 GT/s; 8 x NDR IB, one per GPU.
    "dgx-h100": {**_dgx("h100", 8, nvlink=450e9, pcie=64e9, upi=32e9, ib=50e9),
                 "coefficients": {"link_efficiency": {"nvlink": DGX_H100_NVLINK_EFFICIENCY}}},
    "dgx-h200": {**_dgx("h200", 8, nvlink=450e9, pcie=64e9, upi=32e9, ib=50e9),
                 "coefficients": {"link_efficiency": {"nvlink": DGX_H100_NVLINK_EFFICIENCY}}},
    # Meta's Grand Teton, where torchtitan's H100 rows ran (docs/hardware.md): 8 H100 (96 GB HBM2e, 500 W)
    # per host on NVLink 4 through NVSwitch, 400 Gb/s of RDMA per GPU (RoCE or IB: NCCL drives both with
    # its IB verbs transport), 2 CPU sockets with PCIe Gen5; NVLink at the DGX H100's measured efficiency
    "grand-teton-h100": {**_dgx("h100-gt", 8, nvlink=450e9, pcie=64e9, upi=32e9, ib=50e9),
                         "coefficients": {"link_efficiency": {"nvlink": DGX_H100_NVLINK_EFFICIENCY}}},
    # DGX B200: 2 Xeon sockets, 8 B200 on NVLink5 switches, 8 x 400 Gb/s ConnectX-7 (one per GPU).
    "dgx-b200": _dgx("b200", 8, nvlink=900e9, pcie=64e9, upi=32e9, ib=50e9),
    # the same node with its B200s capped at 750 W (torchao's power-limited MXFP8 rows, docs/hardware.md)
    "dgx-b200-750w": _dgx("b200-750w", 8, nvlink=900e9, pcie=64e9, upi=32e9, ib=50e9),
    # GB200 NVL72: one NVLink domain of 72 GPUs (18 compute trays of 2 Grace + 4 B200 joined by 9 NVLink
    # switch trays). Each GPU has its own 400 Gb/s NIC on a PCIe Gen5 path; the Grace CPUs talk to their
    # GPUs over NVLink-C2C, which no collective here uses, so the domain is drawn with one host socket.
    "gb200-nvl72": _preset("gb200", 72, {"intra": "nvswitch", "sockets": 1, "gpus_per_pcie_switch": 1, "nics": 72,
                                         "nic_attach": "switch", "nic_kind": "ib"},
                           nvlink=900e9, pcie=64e9, ib=50e9),
    # Workstation-class server: 2 GPUs per PCIe switch, 2 x 100 GbE on the CPUs; UPI 10.4 GT/s.
    # (GeForce drivers may disable peer-to-peer; calibration's pcie efficiency absorbs that.)
    "pcie-4090x8": _pcie_box("rtx4090", 2, "cpu", "ethernet", pcie=32e9, upi=20.8e9, ethernet=12.5e9),
    # 4 GPUs and one 200 Gb/s HDR NIC per PCIe switch, one switch per socket.
    "l40s-pcie": _pcie_box("l40s", 4, "switch", "ib", pcie=32e9, upi=20.8e9, ib=25e9),
    # Local gloo runs: worker processes share one host's memory (nominal 5 GB/s per process,
    # 20 us per hop through the loopback), a 10 GbE NIC for multi-host runs.
    # A CPU process runs every matmul at about the same fraction of its peak however small, unlike
    # a GPU that needs large GEMMs to fill its SMs: the GPU-fitted size dependence does not apply.
    "cpu": {**_preset("cpu", 4, {"intra": "shm", "sockets": 1, "gpus_per_pcie_switch": 0, "nics": 1,
                                 "nic_attach": "cpu", "nic_kind": "ethernet"},
                      shm=5e9, pcie=32e9, ethernet=1.25e9),
            # the process runs its Python and its kernels on the same cores: host time adds (p = 1).
            # torch.compile gains nothing here: Inductor's CPU kernels ran the tiny GPT's step 3x slower
            # than eager on one AVX2 core (122 vs 41 ms) after ~110 s of compiling (docs/hardware.md)
            "coefficients": {"gemm_efficiency": 1.0, "gemm_half_flops": 1e6, "host_overlap": 1.0,
                             "compile_elementwise": 1.0, "compile_host": 1.0}},
}


# Presets that describe the machines of one set of published runs, for checking the cost model against
# them: not planning targets of their own, so the policy's held-out set (autopar/envs/workloads.py),
# drawn from the registry, leaves them out and stays the set the README's planner table was measured on.
PUBLISHED_RUN_PRESETS = ("grand-teton-h100", "dgx-b200-750w")


def preset_names() -> list[str]:
    return sorted(PRESETS)
