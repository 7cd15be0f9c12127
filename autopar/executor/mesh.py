"""Process group, device and the device mesh of a plan (one named dimension per axis, `ParallelDims`).

The same code runs on GPUs (NCCL) and on CPUs (gloo): the backend and device follow from
whether this node has a GPU for every rank, unless the caller forces one.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.axes import gradient_axes
from autopar.errors import PlanError
from autopar.executor.options import BACKENDS
from autopar.executor.support import has_nccl
from autopar.plan import Plan

# where launchers other than torchrun put the node-local rank: Slurm's srun, Open MPI's mpirun
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def resolve_backend(backend: str = "auto", local_ranks: int | None = None) -> str:
    """'auto' means NCCL when every rank on this node gets a GPU of its own, gloo otherwise
    (NCCL refuses two ranks on one GPU). `local_ranks`: ranks per node, by default torchrun's
    LOCAL_WORLD_SIZE (1 for a plain `python train.py`)."""
    if backend not in BACKENDS:
        raise PlanError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if 0 < local_ranks <= gpus else "gloo"
    if backend == "nccl" and local_ranks > gpus:
        raise PlanError(f"backend 'nccl' needs a GPU per rank: {local_ranks} rank(s) per node but {gpus} GPU(s) "
                        f"visible; use --nproc-per-node {gpus} or fewer, or --backend gloo" if gpus else
                        "backend 'nccl' needs CUDA GPUs and none is available; use --backend gloo or auto")
    return backend


def local_rank() -> int:
    """This process's rank on its node: from torchrun, srun or mpirun, else the global rank
    modulo the node's GPUs (ranks fill nodes in order)."""
    for name in LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return int(os.environ.get("RANK", "0")) % max(torch.cuda.device_count(), 1)


def init_distributed(backend: str = "auto", timeout_s: float | None = None) -> torch.device:
    """Join the process group torchrun describes (or a one-process group) and pick the device.

    A script started without torchrun gets a world of one, so `autopar.apply` also works in a
    plain `python train.py` for a single-rank plan. A group the caller initialised decides the
    device: a GPU when it reaches GPUs through NCCL ("nccl" or a mixed "cpu:gloo,cuda:nccl").
    """
    backend = current_backend(backend)
    if has_nccl(backend):
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = _group_kwargs(device, timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return device


def _group_kwargs(device: torch.device, timeout_s: float | None) -> dict:
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if device.type == "cuda":  # binds NCCL's communicators to this GPU from the start
        kwargs["device_id"] = device
    return kwargs


def renumber(rank: int, backend: str = "auto", timeout_s: float | None = None) -> None:
    """Join the default process group again as `rank` (the same world, the same store under a prefix
    of its own): a mixed plan numbers its ranks group by group, torchrun numbers nodes as its
    rendezvous sorts them. A collective of every rank."""
    token = [f"{time.time_ns()}.{os.getpid()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # a prefix no earlier group of this job used
    store = dist.PrefixStore(f"autopar.renumbered.{token[0]}", dist.distributed_c10d._get_default_store())
    world, device = dist.get_world_size(), init_distributed(backend, timeout_s)  # initialised: only the device
    dist.destroy_process_group()
    dist.init_process_group(current_backend(backend), store=store, rank=rank, world_size=world,
                            **_group_kwargs(device, timeout_s))


def release_meshes() -> None:
    """Free the meshes and models nothing uses any more, before `dist.destroy_process_group()`.
    DTensor's sharding-propagation caches keep every mesh an op ran on, a mesh keeps its process
    groups (its `_pg_registry`), and models hold them in reference cycles: while any lives,
    destroying the groups does not join gloo's worker threads (see `ParallelModel.close`)."""
    from torch.distributed.tensor import debug  # torch 2.6 lacks the helper: the caches then stay

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
    gc.collect()


def current_backend(backend: str = "auto") -> str:
    """The backend of the process group if one is initialised, else the one `backend` resolves to."""
    return dist.get_backend() if dist.is_initialized() else resolve_backend(backend)


@dataclass(frozen=True)
class Topology:
    """This rank's place in the plan's mesh."""

    mesh: DeviceMesh
    device: torch.device

    def rank(self, axis: str) -> int:
        return self.mesh[axis].get_local_rank()

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh[axis].get_group()

    @functools.cached_property
    def gradient_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks that reduce gradients together: dp, or dp x cp flattened (the
        weights are replicated over cp, as torchtitan's dp_cp mesh)."""
        names = [a for a in self.mesh.mesh_dim_names if a in gradient_axes() and (a == "dp" or self.mesh[a].size() > 1)]
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[tuple(names)]._flatten("_".join(names))

    @property
    def gradient_group(self) -> dist.ProcessGroup:
        return self.gradient_mesh.get_group()

    def sharding_mesh(self, replicas: int) -> DeviceMesh:
        """ZeRO's mesh: the gradient mesh, or under HSDP (`replicas` > 1) FSDP2's 2-D (replicate,
        shard) mesh unflattened from it, the replicas outermost (dp's outer ranks: the capability
        rule keeps dp outside cp in the mesh order), as torchtitan's (dp_replicate, dp_shard_cp)."""
        if replicas == 1:
            return self.gradient_mesh
        made = self.__dict__.setdefault("_sharding_meshes", {})  # one unflatten (its process groups) per degree
        if replicas not in made:
            size = self.gradient_mesh.size()
            made[replicas] = self.gradient_mesh._unflatten(0, (replicas, size // replicas),
                                                           ("dp_replicate", "dp_shard_cp"))
        return made[replicas]

    def shard_group(self, replicas: int) -> dist.ProcessGroup:
        """The ranks ZeRO shards over: the gradient group, or one HSDP replica's shard group."""
        mesh = self.sharding_mesh(replicas)
        return mesh.get_group(mesh.ndim - 1)


def build_mesh(plan: Plan, device: torch.device) -> Topology:
    """The device mesh with one dimension per axis, named as the axis, in the plan's order (outermost first)."""
    world = dist.get_world_size()
    plan.dims.check_world(world, f"{world} were launched", f"launch {plan.world_size} processes or use a plan "
                          f"for {world}", needs="the plan needs ")
    return Topology(plan.dims.build_mesh(device.type), device)
