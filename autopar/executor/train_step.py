"""`apply`: a plan applied to a model, and the train step that hides micro-batching and the
pipeline schedule.

The order is torchtitan's: mesh, fp8 conversion, pipeline cut, tensor parallel, activation
checkpointing, torch.compile of each block, data parallel (DDP / ZeRO-1 / FSDP2), optimizer. The plan is laid out on a meta-device skeleton of
the model; each rank then allocates only its shard and receives rank 0's weights, built from
the seed as a single-process run builds them (`autopar.executor.weights`), so any plan starts
from the same weights as one process and its losses can be compared with one (autopar/executor/parity.py). The
whole model exists once, in rank 0's host RAM, and no stage reaches a device unsharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from autopar.executor.checkpointing import apply_ac
from autopar.executor.context_parallel import context_parallel_step, shard_sequence
from autopar.executor.data import local_share
from autopar.executor.data_parallel import apply_dp, build_optimizer, localised_tp_leaves
from autopar.executor.expert_parallel import (
    ExpertGrads,
    expert_mesh,
    expert_shapes,
    fill_experts,
    fsdp_expert_groups,
    ignore_in_ddp,
    shard_experts,
)
from autopar.executor.mesh import Topology, build_mesh, current_backend, init_distributed, release_meshes
from autopar.executor.pipeline import build_schedule, cut_stages, held_blocks, rank_view, stage_ids
from autopar.executor.precision import autocast, autocast_calls, autocast_forward, compile_blocks, convert_fp8, grad_scaler
from autopar.executor.facts import device_facts, model_layout
from autopar.executor.support import check_supported
from autopar.executor.tensor_parallel import apply_tp
from autopar.executor.tied import TiedGrads, tied_grads, tied_names
from autopar.executor.weights import build_skeleton, build_source, materialise, unsaved_buffers, unwrapped
from autopar.knobs import check_stage_blocks
from autopar.layout import forward_layout
from autopar.modelfile import resolve_tp_plan
from autopar.plan import Plan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _default_blocks(model: nn.Module) -> nn.ModuleList | None:
    """`model.layers` (torchtitan layout), else the longest ModuleList, as the model.py contract says."""
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        return model.layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len, default=None)


def _split(tensors: tuple, n: int) -> list[tuple]:
    return list(zip(*(t.tensor_split(n) for t in tensors)))


@dataclass
class ParallelModel:
    """A model trained under a plan on this rank.

    `model` holds this rank's parameters under the whole model's names (for the optimizer,
    checkpoints and inspection); `parts` are the modules that run (one per pipeline chunk,
    wrapped for data parallelism). With DDP and tensor parallelism together, DDP keeps the TP
    parameters as DTensor attributes between steps; the optimizer's param_groups always hold
    the parameters themselves (`tp_leaves`).
    """

    plan: Plan
    topo: Topology
    model: nn.Module
    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    schedule: object | None = None
    scaler: object | None = None
    has_first_stage: bool = True
    has_last_stage: bool = True
    tp_leaves: list = field(default_factory=list)  # DDP + TP: see data_parallel.localised_tp_leaves
    tied: TiedGrads | None = None  # tied embeddings split across pipeline stages
    experts: ExpertGrads | None = None  # expert-parallel experts: reduced over the expert-data-parallel group

    @property
    def device(self) -> torch.device:
        return self.topo.device

    def local_batch(self, inputs, targets):
        """This rank's share of a global batch, on this rank's device."""
        share = local_share((tuple(inputs), targets), self.plan, self.topo.rank("dp"))
        share = shard_sequence(share, self.plan.cp, self.topo.rank("cp"))
        return tuple(t.to(self.device) for t in share[0]), move_targets(share[1], self.device)

    def train_step(self, inputs: Sequence[torch.Tensor] | torch.Tensor, targets) -> torch.Tensor | None:
        """One optimizer step on this rank's local batch (micro_batch_size x num_micro_batches samples).

        Returns the mean loss over the local batch (detached), or None on a pipeline rank that
        does not hold the last stage; `global_losses` turns these into global-batch losses.
        """
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        self.optimizer.zero_grad(set_to_none=True)
        with context_parallel_step(self.topo, self.plan.cp, inputs[0].shape[1] if inputs[0].dim() > 1 else 1):
            loss = (self._pipeline_step(inputs, targets) if self.schedule is not None
                    else self._plain_step(inputs, targets))
        if self.experts is not None:
            self.experts.sync()
        if self.tied is not None:
            self.tied.sync()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _plain_step(self, inputs, targets) -> torch.Tensor:
        (model,) = self.parts
        n = self.plan.num_micro_batches
        micro_targets = _split(_as_tuple(targets), n)
        if isinstance(targets, torch.Tensor):
            micro_targets = [t for (t,) in micro_targets]
        total = torch.zeros((), device=self.device)
        for i, (micro, target) in enumerate(zip(_split(inputs, n), micro_targets)):
            # DDP reduces gradients only after the last micro-batch
            sync = contextlib.nullcontext()
            if i < n - 1 and isinstance(model, DistributedDataParallel):
                sync = model.no_sync()
            if self.plan.zero == 2 and isinstance(model, FSDPModule):
                # ZeRO-2 replicates parameters: gather them once a step, not once a micro-batch
                # (gradients are still reduce-scattered after each backward: they stay sharded)
                model.set_reshard_after_backward(i == n - 1)
            with sync:
                with autocast(self.plan, self.device):
                    loss = self.loss_fn(model(*micro), target) / n
                self._scaled(loss).backward()
            total += loss.detach()
        return total

    def _pipeline_step(self, inputs, targets) -> torch.Tensor | None:
        losses = [] if self.has_last_stage else None
        args = inputs if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        self.schedule.step(*args, target=target, losses=losses)  # the stages autocast their own forwards
        if losses is None:
            return None
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        return torch.stack([l.detach().float() for l in losses]).mean() / scale

    def close(self) -> None:
        """Release this rank's model, optimizer, schedule and mesh, and collect them: call it before
        `dist.destroy_process_group()`. The parts hold the process groups in reference cycles, which
        a collection at interpreter exit would free only after the groups were destroyed; until the
        last reference goes, gloo's worker threads live on, and one still freeing a finished
        collective's tensors when the interpreter exits aborts the process ("terminate called
        without an active exception"). Once nothing refers to a group, destroying it joins its
        threads. The ParallelModel cannot train after this."""
        self.model = self.parts = self.optimizer = self.schedule = self.scaler = None
        self.tp_leaves, self.tied, self.experts, self.topo = [], None, None, None
        release_meshes()

    def global_losses(self, losses: Sequence[torch.Tensor | None]) -> list[float]:
        """Global-batch mean losses of steps, from every rank's `train_step` results (a collective:
        call it on every rank). Averages over dp and cp; the last pipeline stage supplies the value."""
        local = torch.stack([l.float().reshape(()) if l is not None else torch.zeros(())
                             for l in losses]) if losses else torch.zeros(0)
        if not self.has_last_stage:
            local = torch.zeros_like(local)
        local = local.to(self.device)
        dist.all_reduce(local)  # every tp rank of the last stage holds the same value; cp ranks their tokens'
        return (local / (self.plan.dp * self.plan.tp * self.plan.cp)).tolist()


def _as_tuple(targets) -> tuple:
    return tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)


def move_targets(targets, device):
    """Targets (a tensor, or a tuple/list of them) on `device`."""
    if isinstance(targets, torch.Tensor):
        return targets.to(device)
    return type(targets)(t.to(device) for t in targets)


def _fill_weights(parts, source, unsaved, device, offload: bool, experts: dict, expert_groups, plan: Plan) -> None:
    """Storage and rank 0's weights for this rank's parts; under expert parallelism each rank keeps
    its experts' slice (`experts`: the whole model's expert parameter shapes)."""
    materialise(parts, source, unsaved, device, offload, frozenset(experts))
    if expert_groups is not None:
        fill_experts(parts, source, experts, expert_groups["ep"].get_local_rank(), plan.ep, device, unwrapped)


def apply(plan: Plan, build_model: Callable[[], nn.Module],
          optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], loss_fn: LossFn, *,
          tp_plan: dict[str, str] | Callable[[nn.Module], dict[str, str]] | None = None,
          blocks: Callable[[nn.Module], nn.ModuleList] | None = None, seed: int = 0,
          backend: str = "auto", timeout_s: float | None = None) -> ParallelModel:
    """Apply `plan` on this rank (launched by torchrun, or alone for a one-rank plan).

    build_model: returns the whole model, on the meta device (then initialised with its
        `init_weights()` / `reset_parameters()`) or on the CPU. Called after seeding on rank 0,
        and under `torch.device("meta")` on every rank for the skeleton the plan is laid out on.
    optimizer: makes the optimizer from a list of parameters, e.g.
        `lambda params: torch.optim.AdamW(params, lr=3e-4)`.
    loss_fn: `loss_fn(output, target)`, a mean over the micro-batch.
    tp_plan: {module name (with * wildcards): style}, or a function of the model giving it;
        needed when plan.tp > 1 (styles: `autopar.modelfile.TP_STYLES`).
    blocks: returns the repeated blocks (nn.ModuleList) to pipeline and checkpoint;
        default `model.layers`, else the longest ModuleList.
    seed: the initial weights (the same on every rank and in `parity.reference_losses`).
    backend: "auto" (NCCL when this node has a GPU per rank, else gloo), "nccl" or "gloo", when
        the process group is not initialised yet; timeout_s: its collective timeout.
    """
    check_supported(plan, current_backend(backend))  # before any process group or model exists
    model = build_skeleton(build_model)  # on the meta device: its layout decides what runs
    find_blocks = blocks or _default_blocks
    block_list = find_blocks(model)
    if plan.stage_recompute:  # each stage recomputes at most its blocks: one line, before any process group
        check_stage_blocks(plan.stage_recompute, plan.split_for(len(block_list or ())))
    tp_map = (resolve_tp_plan(model, tp_plan(model) if callable(tp_plan) else tp_plan)
              if plan.tp > 1 and tp_plan is not None else None)  # None: no tp_plan given
    check_supported(plan, current_backend(backend), model_layout(model, block_list, tp_map))
    device = init_distributed(backend, timeout_s)
    check_supported(plan, current_backend(backend), device=device_facts(device))  # fp8's tensor cores
    topo = build_mesh(plan, device)
    source = build_source(build_model, seed)  # the whole model, on rank 0 only
    unsaved = unsaved_buffers(model)
    convert_fp8(list(block_list or ()), plan)  # on the skeleton, before tensor parallelism (torchtitan's order)
    tied = tied_names(model)
    expert_groups = expert_mesh(plan, device.type) if plan.ep > 1 else None
    experts = expert_shapes(model) if expert_groups is not None else {}  # the whole model's, before the cut
    tp_map = tp_map or {}
    pp_rank = topo.rank("pp")
    layout = forward_layout(model, block_list)  # the forward's order: the stage cut and the stream's ends
    inner = cut_stages(model, block_list, plan, pp_rank, layout) if plan.pp > 1 else [model]
    held = [held_blocks(part, layout) for part in inner]  # (parent, name) of each block a part runs
    del model
    torch.manual_seed(seed + 1 + pp_rank + plan.pp * topo.rank("dp"))  # dropout: same on tp peers
    for part, blocks_held in zip(inner, held):
        if expert_groups is not None:  # on the skeleton: each rank allocates its experts only
            shard_experts(part, plan.ep, expert_groups["ep"].get_group())
        if plan.tp > 1:  # on the skeleton: only this rank's shards will get storage
            apply_tp(part, topo.mesh["tp"], tp_map, [c._modules[k] for c, k in blocks_held], plan.sequence_parallel,
                     layout)
        if plan.pp > 1:  # the schedule runs forward and backward in one call: autocast the forward only
            autocast_forward(part, plan, device)
    apply_ac(held, stage_ids(plan, pp_rank), plan)
    compile_blocks([c._modules[k] for blocks_held in held for c, k in blocks_held], plan)
    weights = (inner, source, unsaved, device, plan.offload_optimizer and plan.zero >= 2, experts, expert_groups)
    if plan.zero < 2:  # DDP needs real parameters; FSDP2 shards the skeleton first
        _fill_weights(*weights, plan)
    if expert_groups is not None and plan.zero == 0:
        for part in inner:
            ignore_in_ddp(part)
    own = fsdp_expert_groups(inner, expert_groups) if expert_groups is not None and plan.zero >= 2 else None
    parts = [apply_dp(part, [c._modules[k] for c, k in blocks_held], plan, topo, own)
             for part, blocks_held in zip(inner, held)]
    if plan.zero >= 2:
        _fill_weights(*weights, plan)
    del source, weights
    view = rank_view(inner) if plan.pp > 1 else inner[0]
    opt = build_optimizer(list(view.parameters()), optimizer, plan, topo)
    scaler = grad_scaler(plan, device)
    result = ParallelModel(plan, topo, view, parts, opt, loss_fn, scaler=scaler, tp_leaves=localised_tp_leaves(view),
                           tied=tied_grads(view, tied, plan, topo),
                           experts=ExpertGrads(inner, plan, expert_groups["edp"].get_group())
                           if expert_groups is not None else None)
    if plan.pp > 1:
        ids = stage_ids(plan, pp_rank)
        result.has_first_stage = 0 in ids
        result.has_last_stage = plan.stages - 1 in ids
        stage_loss = autocast_calls(loss_fn, plan, device)
        result.schedule = build_schedule(parts, plan, pp_rank, device, topo.group("pp"),
                                         lambda out, tgt: result._scaled(stage_loss(out, tgt)))
    if device.type == "cuda":  # peak memory from here on is the training's, not the set-up's
        torch.cuda.reset_peak_memory_stats(device)
    return result
