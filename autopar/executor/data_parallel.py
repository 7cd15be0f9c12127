"""Data parallelism by ZeRO stage: DDP (0), DDP + sharded optimizer (1), FSDP2 (2, 3).

* 0: `DistributedDataParallel` with the plan's bucket size, and a bf16/fp16 compression comm
  hook when the plan reduces gradients in 16 bits (Horovod's fp16 compression);
* 1: the same DDP, and the optimizer state sharded by `ZeroRedundancyOptimizer`;
* 2: FSDP2 `fully_shard` keeping parameters gathered between forward and backward
  (`reshard_after_forward=False`: sharded gradients and optimizer state, ZeRO-2's memory);
* 3: FSDP2 `fully_shard` resharding after forward (ZeRO-3).
Both FSDP stages shard each block, then the rest, and offload to the CPU when planned. Under HSDP
(dp_replicate > 1) FSDP2 shards on the 2-D (replicate, shard) mesh (reduce-scatter within the shard
group, all-reduce across the replicas), and ZeRO-1's optimizer shards over the shard group after
DDP's all-reduce over all of dp x cp (each replica steps and broadcasts the same shards).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from autopar.executor.mesh import Topology
from autopar.executor.precision import DTYPES
from autopar.plan import Plan

_COMPRESS_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


def apply_ddp(module: nn.Module, plan: Plan, topo: Topology) -> nn.Module:
    """Wrap in DDP over the dp (x cp) ranks (ZeRO 0 and 1); a no-op with dp x cp = 1."""
    if topo.gradient_mesh.size() == 1:
        return module
    device_ids = [topo.device.index] if topo.device.type == "cuda" else None
    tensor_parallel = any(isinstance(p, DTensor) for p in module.parameters())
    # DDP takes a device mesh only for DTensor (TP) parameters: it then localises them
    where = {"device_mesh": topo.gradient_mesh} if tensor_parallel else {"process_group": topo.gradient_group}
    ddp = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=plan.bucket_mb, **where)
    if plan.grad_comm_dtype in _COMPRESS_HOOKS:
        ddp.register_comm_hook(topo.gradient_group, _COMPRESS_HOOKS[plan.grad_comm_dtype])
    return ddp


def localised_tp_leaves(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(owner, name, leaf) of the TP parameters DDP holds as local leaves. DDP rebuilds them into
    DTensor attributes in the first forward and leaves those in place, so after it the module no
    longer lists them as parameters; `reattach` puts the leaves back (for state dicts)."""
    return [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
            if p is not None and hasattr(p, "_st_info")]


def reattach(leaves: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Make the leaves the modules' parameters again (between steps only: recomputation in
    backward needs the forward's DTensor attributes; the next forward rebuilds them)."""
    for owner, name, leaf in leaves:
        if owner._parameters.get(name) is not leaf:
            owner.__dict__.pop(name, None)
            owner._parameters[name] = leaf


def apply_fsdp(module: nn.Module, blocks: list[nn.Module], plan: Plan, topo: Topology,
               own_groups: list | None = None) -> nn.Module:
    """FSDP2 over the dp (x cp) ranks, one unit per block and one for the rest (ZeRO 2 and 3).
    `own_groups`: (module, mesh) sharded first over a mesh of their own (expert-parallel experts
    over the expert-data-parallel ranks)."""
    compute = DTYPES[plan.precision]
    mp = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                              reduce_dtype=DTYPES[plan.grad_comm_dtype])
    # pinned host memory speeds GPU<->CPU copies; it needs an accelerator
    offload = (CPUOffloadPolicy(pin_memory=topo.device.type == "cuda") if plan.offload_optimizer
               else OffloadPolicy())
    kwargs = {"mesh": topo.sharding_mesh(plan.dp_replicate), "reshard_after_forward": plan.zero == 3,
              "mp_policy": mp, "offload_policy": offload}
    if compute != torch.float32:
        # batch norms keep fp32 weights beside their fp32 running statistics (bf16 weights with fp32
        # statistics fail on the CPU); they normalise the low-precision input as usual
        keep = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=DTYPES[plan.grad_comm_dtype])
        for norm in [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, **{**kwargs, "mp_policy": keep})
    for sub, mesh in own_groups or ():
        fully_shard(sub, **{**kwargs, "mesh": mesh})
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module


def apply_dp(module: nn.Module, blocks: list[nn.Module], plan: Plan, topo: Topology,
             own_groups: list | None = None) -> nn.Module:
    return apply_fsdp(module, blocks, plan, topo, own_groups) if plan.zero >= 2 else apply_ddp(module, plan, topo)


def build_optimizer(params: list[nn.Parameter], optimizer_fn, plan: Plan, topo: Topology) -> torch.optim.Optimizer:
    """The user's optimizer over `params`; for ZeRO-1 the same class and settings, its state
    sharded over the dp (x cp) ranks, or an HSDP replica's shard group."""
    optimizer = optimizer_fn(params)
    if plan.zero != 1 or topo.gradient_mesh.size() == 1:
        return optimizer
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters  # defaults may hold derived settings
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    # bucket views: after the step each rank broadcasts its shard as one buffer, not one call per parameter
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=topo.shard_group(plan.dp_replicate),
                                   parameters_as_bucket_view=True, **settings)
