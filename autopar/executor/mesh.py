"""Process group, device and the device mesh of a plan (one named dimension per axis, `ParallelDims`).

The same code runs on GPUs (NCCL) and on CPUs (gloo): the backend and device follow from
whether CUDA is present, unless the caller forces one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanError
from autopar.plan import Plan

BACKENDS = ("auto", "nccl", "gloo")


def resolve_backend(backend: str = "auto") -> str:
    """'auto' means NCCL when CUDA is available, gloo otherwise."""
    if backend not in BACKENDS:
        raise PlanError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise PlanError("backend 'nccl' needs CUDA GPUs and none is available; use --backend gloo or auto")
    return backend


def init_distributed(backend: str = "auto", timeout_s: float | None = None) -> torch.device:
    """Join the process group torchrun describes (or a one-process group) and pick the device.

    A script started without torchrun gets a world of one, so `autopar.apply` also works in a
    plain `python train.py` for a single-rank plan.
    """
    backend = dist.get_backend() if dist.is_initialized() else resolve_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if "RANK" in os.environ:
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return device


@dataclass(frozen=True)
class Topology:
    """This rank's place in the plan's mesh."""

    mesh: DeviceMesh
    device: torch.device

    def rank(self, axis: str) -> int:
        return self.mesh[axis].get_local_rank()

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh[axis].get_group()


def build_mesh(plan: Plan, device: torch.device) -> Topology:
    """The device mesh with one dimension per axis, named as the axis, in the plan's order (outermost first)."""
    world = dist.get_world_size()
    plan.dims.check_world(world, f"{world} were launched", f"launch {plan.world_size} processes or use a plan "
                          f"for {world}", needs="the plan needs ")
    return Topology(plan.dims.build_mesh(device.type), device)
