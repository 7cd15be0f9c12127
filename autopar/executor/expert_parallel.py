"""Expert parallelism: each of the ep ranks holds experts / ep of every MoE layer's routed experts.

The ep ranks are the innermost ranks of dp (`autopar.axes`: the folded axis ep), as Megatron-Core
and torchtitan lay them out; the ranks holding the same experts form the expert-data-parallel
group (dp / ep of them). Tokens leave their rank sorted by expert (the model's MoE layer sorts
them); dispatch first exchanges the token counts per expert (`all_to_all_single` of E integers),
then the tokens with those uneven splits, and the combine sends the results back the same way.
Both token exchanges are torch's `all_to_all_single_autograd` (`torch.distributed._functional_collectives`,
as torchtitan; `torch.distributed.nn.functional.all_to_all_single` is deprecated in torch 2.13),
whose backward is the reverse all-to-all, so autograd runs through them on gloo as on NCCL. Routing is dropless:
no capacity, every routed token is computed.

Gradients: DDP leaves the expert parameters alone (they differ across the ep ranks); after the
last micro-batch their gradients are summed over the expert-data-parallel group and divided by
dp, which is what DDP's mean over dp gives every other parameter (the all-to-all's backward has
already brought each expert the gradients of its ep peers' tokens).

Under FSDP2 (ZeRO 2 and 3) each layer's experts are their own FSDP unit over the expert-data-
parallel mesh (torchtitan's layout), their gradients averaged there by FSDP2 and rescaled to the
same sum / dp; ZeroRedundancyOptimizer
(ZeRO-1) would broadcast one rank's experts over another's, and sequence parallelism would give
the experts of tp peers different tokens with no reduction over tp: both are refused with ep > 1
(`autopar.executor.support`) and left out of the plan space. Works with the zoo's MoE layers
(`autopar.zoo.moe`, and `hf:` Mixtral / Qwen3-MoE, which use them): a module with `moe_shape()`
whose `experts` are stacked as `GroupedExperts`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from autopar.plan import Plan
from autopar.zoo.moe import GroupedExperts

EXPERT_DIM = 0  # experts are stacked along dim 0 of w1, w2, w3


def expert_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The plan's mesh with dp split into (edp, ep), ep innermost: its "ep" and "edp" dimensions
    give the expert-parallel and expert-data-parallel groups."""
    names, shape = [], []
    for axis in plan.mesh_order:
        if axis == "dp":
            names += ["edp", "ep"]
            shape += [plan.dp // plan.ep, plan.ep]
        else:
            names.append(axis)
            shape.append(getattr(plan, axis))
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def _stacked(experts) -> bool:
    """The zoo's expert layout (`GroupedExperts`: w1, w2, w3 stacked along dim 0), by shape: a
    model.py loaded by path defines its own copy of the class."""
    return (isinstance(experts, nn.Module) and isinstance(getattr(experts, "num_experts", None), int)
            and all(isinstance(getattr(experts, w, None), nn.Parameter) for w in ("w1", "w2", "w3")))


def moe_experts(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(MoE layer, its routed experts) for every MoE layer of `model` that the executor can shard."""
    return [(m, m.experts) for m in model.modules()
            if callable(getattr(m, "moe_shape", None)) and _stacked(getattr(m, "experts", None))
            and not isinstance(m.experts, ShardedExperts)]


def expert_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """{name: full shape} of every routed-expert parameter (from the whole model's skeleton; the
    same names in the same order on every rank)."""
    ids = {id(p) for _, experts in moe_experts(model) for p in experts.parameters()}
    return {name: p.shape for name, p in model.named_parameters() if id(p) in ids}


class ShardedExperts(GroupedExperts):
    """The experts [rank x E / ep, (rank + 1) x E / ep) of a MoE layer, under the same parameter
    names, with dispatch and combine over the ep group."""

    def __init__(self, whole: nn.Module, ep: int, group: dist.ProcessGroup):
        with torch.device(whole.w1.device):
            super().__init__(whole.num_experts // ep, whole.hidden, whole.ffn,
                             bias=getattr(whole, "b1", None) is not None)
        self.total, self.ep, self.group = whole.num_experts, ep, group

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = self.num_experts
        send = torch.tensor(counts, dtype=torch.int64, device=x.device)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)  # [source][my local expert] counts
        send_splits = send.view(self.ep, local).sum(1).tolist()
        by_source = received.view(self.ep, local)
        recv_splits = by_source.sum(1).tolist()
        tokens = _exchange(x, recv_splits, send_splits, self.group)
        # received grouped by source, then expert; the experts need them grouped by expert
        pieces = by_source.reshape(-1).tolist()
        chunks = tokens.split(pieces)
        by_expert = [chunks[s * local + e] for e in range(local) for s in range(self.ep)]
        out = super().forward(torch.cat(by_expert), by_source.sum(0).tolist())
        done = out.split([pieces[s * local + e] for e in range(local) for s in range(self.ep)])
        back = torch.cat([done[e * self.ep + s] for s in range(self.ep) for e in range(local)])
        return _exchange(back, send_splits, recv_splits, self.group)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all with uneven splits whose backward is the reverse all-to-all (torch's functional
    collective: the one torchtitan's expert parallelism uses; `torch.distributed.nn`'s is deprecated)."""
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def shard_experts(part: nn.Module, ep: int, group: dist.ProcessGroup) -> list[ShardedExperts]:
    """Replace each MoE layer's experts in `part` (a skeleton) by this rank's shard of them."""
    out = []
    for layer, experts in moe_experts(part):
        layer.experts = ShardedExperts(experts, ep, group)
        out.append(layer.experts)
    return out


def expert_param_names(part: nn.Module) -> list[str]:
    """Names (in `part`) of its sharded expert parameters: DDP must leave them alone."""
    ids = {id(p) for m in part.modules() if isinstance(m, ShardedExperts) for p in m.parameters()}
    return [name for name, p in part.named_parameters() if id(p) in ids]


def ignore_in_ddp(part: nn.Module) -> None:
    """DDP reduces over dp; the experts reduce over the expert-data-parallel group instead."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, expert_param_names(part))


def fill_experts(parts: list[nn.Module], source: nn.Module | None, shapes: dict[str, torch.Size],
                 ep_rank: int, ep: int, device: torch.device, unwrap) -> None:
    """Rank 0's expert weights, one tensor at a time (every rank in the same order), each rank
    keeping its slice of experts. A collective over the whole world."""
    mine = {}
    for part in parts:
        names = set(expert_param_names(part))
        mine.update({unwrap(name): p for name, p in part.named_parameters() if name in names})
    full = dict(source.named_parameters()) if source is not None else {}
    with torch.no_grad():
        for name, shape in shapes.items():
            value = full[name].detach().to(device) if source is not None else torch.empty(shape, device=device)
            dist.broadcast(value, 0)
            if name in mine:
                _assign(mine[name], value.chunk(ep, dim=EXPERT_DIM)[ep_rank])


def _assign(param: nn.Parameter, local: torch.Tensor) -> None:
    """Copy this rank's experts into `param`, or (FSDP2 over the expert-data-parallel ranks, a
    DTensor) its shard of them: every rank holds `local` whole, so no communication."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(local)


def fsdp_expert_groups(parts: list[nn.Module], meshes: DeviceMesh) -> list:
    """(experts, expert-data-parallel mesh) for FSDP2: each MoE layer's experts shard over the
    ranks holding the same experts (their gradients: `ExpertGrads`)."""
    return [(m, meshes["edp"]) for part in parts for m in part.modules() if isinstance(m, ShardedExperts)]


class ExpertGrads:
    """The expert gradients' reduction over the expert-data-parallel group: summed there and
    divided by dp. Under DDP (`sync` all-reduces them); under FSDP2, whose reduce-scatter already
    averaged them over that group (dp / ep ranks; PREMUL_SUM, FSDP2's custom divide factor, does
    not exist on gloo), `sync` only rescales the local shards by 1 / ep. Call it on every rank after
    the last backward of a step."""

    def __init__(self, parts: list[nn.Module], plan: Plan, group: dist.ProcessGroup):
        self.params = [p for part in parts for m in part.modules() if isinstance(m, ShardedExperts)
                       for p in m.parameters()]
        self.dp, self.ep, self.group, self.fsdp = plan.dp, plan.ep, group, plan.zero >= 2

    def sync(self) -> None:
        for p in self.params:
            if self.fsdp:
                if p.grad is not None:
                    p.grad.to_local().div_(self.ep)
                continue
            if p.grad is None:  # a stage's experts that saw no token still take part
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.dp)
