"""The local machine as a Cluster: its CUDA GPUs, or gloo worker processes on its CPUs."""

from __future__ import annotations

import dataclasses
import os

from autopar.cluster.gpus import GPUS, derive_gpu, match_gpu
from autopar.cluster.io import load_cluster
from autopar.cluster.topology import Cluster

# The preset whose node wiring a machine with these GPUs most likely has. SXM parts sit on an
# NVSwitch board; PCIe cards and unknown GPUs get the generic two-socket PCIe server layout.
_LAYOUT_OF_GPU = {"v100-32g": "dgx-v100", "a100-40g": "dgx-a100-40g", "a100-80g": "dgx-a100-80g",
                  "h100": "dgx-h100", "h200": "dgx-h200", "rtx4090": "pcie-4090x8"}
_PCIE_LAYOUT = "l40s-pcie"


def detect() -> Cluster:
    """One node of this machine's CUDA GPUs if there are any, else the `cpu` preset with one
    worker process per CPU core, each with its share of host memory."""
    import torch  # only detection needs torch

    if torch.cuda.is_available():
        return _cuda_node(torch.cuda)
    return _cpu_node()


def _cuda_node(cuda) -> Cluster:
    props = cuda.get_device_properties(0)
    key = match_gpu(props.name, props.total_memory)
    gpu = dataclasses.replace(GPUS[key], memory_bytes=float(props.total_memory)) if key else derive_gpu(props)
    layout = _PCIE_LAYOUT if "pcie" in props.name.lower() else _LAYOUT_OF_GPU.get(key, _PCIE_LAYOUT)
    base = load_cluster(layout, nodes=1, gpus_per_node=cuda.device_count())
    return dataclasses.replace(base, name=f"local-{layout}", gpu=gpu)


def _cpu_node() -> Cluster:
    processes = os.cpu_count() or 1
    base = load_cluster("cpu", nodes=1, gpus_per_node=processes)
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: keep the nominal share
        return dataclasses.replace(base, name="local-cpu")
    gpu = dataclasses.replace(base.gpu, memory_bytes=float(host_bytes / processes))
    return dataclasses.replace(base, name="local-cpu", gpu=gpu)
