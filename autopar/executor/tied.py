"""Tied weights (a language model's input and output embeddings) under tensor and pipeline parallelism.

In one process a tied weight is one parameter and autograd sums the gradients of both uses.
Tensor parallelism gives each module its own sharded parameter, and pipeline stages each hold a
copy (the first stage the embedding, the last the head); the copies start equal. `TiedGrads`
sums the copies' gradients before every optimizer step (on the rank for tensor parallelism,
between the first and last pipeline rank as Megatron-LM's embedding group does), so they get
the same update and stay equal. Both copies must be sharded alike (e.g. 'vocab' on the
embedding and on the head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import PlanError


def tied_names(model: nn.Module) -> list[tuple[str, str]]:
    """(first name, other name) of each parameter the model holds under two names."""
    seen, pairs = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            pairs.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return pairs


def _get(module: nn.Module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None  # not on this pipeline stage


def _pair_group(topo, plan) -> dist.ProcessGroup:
    """The group of the first and the last pipeline rank with this rank's dp/tp coordinates."""
    if plan.pp == 2:
        return topo.group("pp")
    ranks = topo.mesh.mesh.movedim(list(plan.mesh_order).index("pp"), -1).reshape(-1, plan.pp)
    mine = None
    for row in ranks.tolist():  # every rank creates every group, in the same order
        group = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in (row[0], row[-1]):
            mine = group
    return mine


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grad(p: nn.Parameter) -> torch.Tensor:
    """p's local gradient laid out as p is (a DTensor gradient may come back replicated)."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return _local(p.grad)


@dataclass
class TiedGrads:
    """Copies of tied weights on this rank: pairs held here, and copies whose partner is on
    another pipeline rank (summed over `group`)."""

    pairs: list[tuple[nn.Parameter, nn.Parameter]]
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None

    def sync(self) -> None:
        for p, q in self.pairs:
            if p.grad is not None and q.grad is not None:
                total = _grad(p) + _grad(q)
                _grad(p).copy_(total)
                _grad(q).copy_(total)
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(_grad(p), group=self.group)


def tied_grads(view: nn.Module, names: list[tuple[str, str]], plan, topo) -> TiedGrads | None:
    """The copies to keep equal (None when there are none). Collective: every rank calls it."""
    pairs, params = [], []
    for a, b in names:
        pa, pb = _get(view, a), _get(view, b)
        if pa is not None and pb is not None:
            if pa is not pb:
                if _local(pa).shape != _local(pb).shape:
                    raise PlanError(f"tied weights {a} and {b} are sharded differently by the tp_plan; give "
                                    "both modules the same style ('vocab') or use tp=1")
                pairs.append((pa, pb))
        elif pa is not None or pb is not None:
            params.append(pa if pa is not None else pb)
    group = _pair_group(topo, plan) if plan.pp > 1 and names else None
    if plan.pp > 1 and topo.rank("pp") not in (0, plan.pp - 1):
        params = []
    return TiedGrads(pairs, params, group) if pairs or params else None
