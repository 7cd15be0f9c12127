"""`apply_mixed`: a mixed plan (lanes of segments over GPU groups, `autopar.mixed.plan`) applied on
this rank, labelled with its group (`mixed_layout.RankLabel`).

* Data-parallel lanes of one layout run through `apply` as one homogeneous plan (`executed_plan`):
  DDP / FSDP2 / ZeRO-1, tensor and pipeline parallelism inside each replica as for any plan. Each rank
  trains its lane's micro-batches of its lane's share and scales its loss by
  `loss_weight` (D x its samples / G), so data parallelism's average of the D replicas' gradients is
  the sample-weighted one: the update equals one process's on the whole batch, whatever the shares.
* One lane spanning segments (`SpanningLane`): each stage is cut from the model as `apply` cuts
  (`pipeline.cut_stages`) and tensor-parallel over its own ranks with DTensor (`apply_tp` on a mesh
  of the stage's process group). The stage boundaries are torch's P2P ops (`batch_isend_irecv`) in
  Megatron-LM's 1F1B order (GPipe: all forwards first). Why not `torch.distributed.pipelining`: a
  `PipelineStage` is one rank of one pp process group and talks to the one rank of each
  neighbouring stage; a stage held by two tensor-parallel ranks feeding a stage held by one needs a
  stage whose input comes from (and whose input gradient goes back to) several ranks, which neither
  `PipelineStage` nor its schedules can express (torchtitan builds one pp group per tp rank, which
  needs the same tp on every stage). The boundary: the first rank of stage s sends the stream
  (replicated over its tp group) to every rank of stage s + 1; the first rank of stage s + 1 sends
  its input's gradient (whole on every tp rank: DTensor's region input reduces it) to every rank of
  stage s.
On NCCL each group's ranks must sit on that group's nodes (ranks are numbered group by group); that
path is unverified: no mixed machine. Unsupported mixed plans are refused before launch by
`autopar.capability.mixed`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capability.mixed import check_mixed
from autopar.errors import PlanError
from autopar.executor.checkpointing import apply_ac
from autopar.executor.context_parallel import shard_sequence
from autopar.executor.facts import model_layout
from autopar.executor.mesh import init_distributed, release_meshes
from autopar.executor.mixed_layout import (
    RankLabel,
    check_world,
    data_parallel,
    executed_plan,
    loss_weight,
    rank_labels,
    rank_samples,
    stage_ranks,
)
from autopar.executor.pipeline import cut_stages, held_blocks
from autopar.executor.preflight import preflight
from autopar.executor.precision import autocast, compile_blocks
from autopar.executor.support import check_supported, target
from autopar.executor.tensor_parallel import apply_tp
from autopar.executor.tied import tied_names
from autopar.executor.train_step import ParallelModel, _default_blocks, _split, apply, move_targets
from autopar.executor.weights import build_skeleton, build_source, materialise, unsaved_buffers
from autopar.layout import forward_layout
from autopar.modelfile import resolve_tp_plan


SPLIT_TIES = ("the model ties weights (one parameter under two names), which a lane spanning segments cannot "
              "split between stages yet; untie them, or use data-parallel lanes")


@dataclass(frozen=True)
class MixedSummary:
    """What a mixed run reports beside its losses (the worker reads these of `par.plan`): the global
    batch, the precision, and the micro-batching that decides BatchNorm's statistics."""

    global_batch: int
    precision: str
    dp: int
    micro_batch_size: int
    num_micro_batches: int


def summary(mixed_plan) -> MixedSummary:
    plans = [lane.plan for lane in mixed_plan.lanes]
    return MixedSummary(sum(lane.share for lane in mixed_plan.lanes), plans[0].precision, sum(p.dp for p in plans),
                        min(p.micro_batch_size for p in plans), max(p.num_micro_batches for p in plans))


def _take(batch, index: torch.Tensor):
    """The samples `index` of a batch (a tensor or nested tuples/lists of tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    return type(batch)(_take(item, index) for item in batch)


@dataclass
class DataParallelLanes:
    """This rank of data-parallel lanes: the homogeneous `ParallelModel` it trains, its label and
    the samples it trains."""

    par: ParallelModel
    mixed_plan: object
    label: RankLabel
    labels: list[RankLabel]
    plan: MixedSummary

    @property
    def device(self) -> torch.device:
        return self.par.device

    # what a checkpoint saves and loads (`autopar.executor.state`): the homogeneous model's
    @property
    def model(self) -> nn.Module:
        return self.par.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.par.optimizer

    @property
    def tp_leaves(self) -> list:
        return self.par.tp_leaves

    def local_batch(self, inputs, targets):
        """This rank's samples of a global batch (its lane's share, its replica's part), its tokens under cp."""
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        total = inputs[0].shape[0]
        if total != self.plan.global_batch:
            raise ValueError(f"batch has {total} samples but the mixed plan's global batch is {self.plan.global_batch}")
        index = torch.tensor(list(rank_samples(self.mixed_plan, self.label)), dtype=torch.long)
        share = (_take(inputs, index), _take(targets, index))
        share = shard_sequence(share, self.par.plan.cp, self.par.topo.rank("cp"))
        return tuple(t.to(self.device) for t in share[0]), move_targets(share[1], self.device)

    def train_step(self, inputs, targets):
        """One step; the loss it returns is weighted (`loss_weight`): `global_losses` averages them to the
        global batch's mean."""
        return self.par.train_step(inputs, targets)

    def global_losses(self, losses) -> list[float]:
        return self.par.global_losses(losses)

    def close(self) -> None:
        self.par.close()


def _weighted(loss_fn, weight: float):
    def loss(output, target):
        return loss_fn(output, target) * weight
    return loss


@dataclass
class SpanningLane:
    """This rank's stage of one lane whose pipeline spans segments (module doc): its stage module,
    the ranks of every stage, and the 1F1B / GPipe schedule over P2P boundaries."""

    plan: MixedSummary
    lane_plan: object  # the lane's Plan
    label: RankLabel
    labels: list[RankLabel]
    stages: list[list[int]]
    part: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    device: torch.device
    groups: list = field(default_factory=list)
    _meta: list | None = None  # (shape, dtype) of the tensors crossing into this stage
    _announced: bool = False  # the next stage knows the shapes of what this stage sends

    # what a checkpoint saves and loads (`autopar.executor.state`): the stage keeps the whole model's names
    @property
    def model(self) -> nn.Module:
        return self.part

    @property
    def tp_leaves(self) -> list:
        return []

    @property
    def first(self) -> bool:
        return self.label.stage == 0

    @property
    def last(self) -> bool:
        return self.label.stage == len(self.stages) - 1

    def local_batch(self, inputs, targets):
        """dp 1: every stage rank sees the whole batch (the first stage reads inputs, the last targets)."""
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return tuple(t.to(self.device) for t in inputs), move_targets(targets, self.device)

    # -- the boundaries --------------------------------------------------------------------------
    def _next(self) -> list[int]:
        return self.stages[self.label.stage + 1] if not self.last else []

    def _prev(self) -> list[int]:
        return self.stages[self.label.stage - 1] if not self.first else []

    def _leader(self) -> bool:
        return self.label.tp_rank == 0

    def _send_fwd_ops(self, outputs: list[torch.Tensor]) -> list:
        if self.last or not self._leader():
            return []
        return [dist.P2POp(dist.isend, t.detach().contiguous(), dst) for dst in self._next() for t in outputs]

    def _recv_fwd_ops(self) -> tuple[list, list[torch.Tensor]]:
        if self.first:
            return [], []
        src = self._prev()[0]
        if self._meta is None:  # the first micro-batch of the first step: shapes and dtypes, once
            got = [None]
            dist.recv_object_list(got, src)
            self._meta = got[0]
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._meta]
        return [dist.P2POp(dist.irecv, b, src) for b in bufs], bufs

    def _send_bwd_ops(self, grads: list[torch.Tensor]) -> list:
        if self.first or not self._leader():
            return []
        return [dist.P2POp(dist.isend, g.contiguous(), dst) for dst in self._prev() for g in grads]

    def _recv_bwd_ops(self, outputs: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        if self.last:
            return [], []
        src = self._next()[0]
        bufs = [torch.empty_like(t) for t in outputs if t.is_floating_point()]
        return [dist.P2POp(dist.irecv, b, src) for b in bufs], bufs

    @staticmethod
    def _run(ops: list) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _announce(self, outputs: list[torch.Tensor]) -> None:
        """Before the first forward send: tell the next stage the shapes it receives."""
        if self.last or not self._leader() or self._announced:
            return
        for dst in self._next():
            dist.send_object_list([[(tuple(t.shape), t.dtype) for t in outputs]], dst)
        self._announced = True

    # -- one micro-batch ---------------------------------------------------------------------------
    def _forward(self, received: list[torch.Tensor], micro, target, n: int):
        """(inputs to keep for backward, outputs or the loss)."""
        inputs = [t.requires_grad_() if t.is_floating_point() else t for t in received]
        args = micro if self.first else tuple(inputs)
        with autocast(self.lane_plan, self.device):
            out = self.part(*args)
            if self.last:
                return inputs, self.loss_fn(out, target) / n
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        return inputs, outputs

    def _backward(self, inputs, outputs, grads) -> list[torch.Tensor]:
        if self.last:
            outputs.backward()
        else:
            floats = [t for t in outputs if t.is_floating_point()]
            torch.autograd.backward(floats, grads)
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]

    def train_step(self, inputs, targets) -> torch.Tensor | None:
        """One optimizer step over num_micro_batches micro-batches: 1F1B (Megatron-LM's non-interleaved
        order), or GPipe (every forward, then every backward). Returns the batch's mean loss on the last
        stage, None elsewhere."""
        n = self.lane_plan.num_micro_batches
        stage, stages = self.label.stage, len(self.stages)
        micros = _split(inputs, n) if self.first else [()] * n
        micro_targets = [None] * n
        if self.last:
            micro_targets = [t for (t,) in _split((targets,), n)] if isinstance(targets, torch.Tensor) else \
                [tuple(t) for t in _split(tuple(targets), n)]
        warmup = n if self.lane_plan.schedule == "gpipe" else min(stages - stage - 1, n)
        self.optimizer.zero_grad(set_to_none=True)
        held = deque()  # (inputs, outputs) of micro-batches whose backward is still to run
        total = torch.zeros((), device=self.device)
        done = 0  # forwards run

        def forward(received):
            nonlocal done, total
            ins, outs = self._forward(received, micros[done], micro_targets[done], n)
            done += 1
            if self.last:
                total += outs.detach()
            else:
                self._announce(outs)
            held.append((ins, outs))
            return outs

        def backward(grads):
            ins, outs = held.popleft()
            return self._backward(ins, outs, grads)

        for _ in range(warmup):
            ops, received = self._recv_fwd_ops()
            self._run(ops)
            outs = forward(received)
            if not self.last:
                self._run(self._send_fwd_ops(outs))
        remaining = n - warmup
        received = []
        if remaining:
            ops, received = self._recv_fwd_ops()
            self._run(ops)
        for i in range(remaining):
            outs = forward(received)
            ops, grads = self._recv_bwd_ops(outs if not self.last else [])
            self._run(self._send_fwd_ops(outs if not self.last else []) + ops)
            grad_in = backward(grads)
            if i == remaining - 1:
                self._run(self._send_bwd_ops(grad_in))
            else:
                ops, received = self._recv_fwd_ops()
                self._run(self._send_bwd_ops(grad_in) + ops)
        for _ in range(warmup):
            ins, outs = held[0]
            ops, grads = self._recv_bwd_ops(outs if not self.last else [])
            self._run(ops)
            self._run(self._send_bwd_ops(backward(grads)))
        self.optimizer.step()
        return total if self.last else None

    def global_losses(self, losses) -> list[float]:
        """The batch's mean loss of each step, from the last stage's first rank (a collective)."""
        mine = self.last and self._leader()
        local = torch.stack([l.float().reshape(()) if (mine and l is not None) else torch.zeros(())
                             for l in losses]) if losses else torch.zeros(0)
        local = local.to(self.device)
        dist.all_reduce(local)
        return local.tolist()

    def close(self) -> None:
        self.part = self.optimizer = None
        self.groups = []
        release_meshes()


def apply_mixed(mixed_plan, build_model: Callable[[], nn.Module], optimizer, loss_fn, *, tp_plan=None,
                blocks=None, seed: int = 0, backend: str = "auto", timeout_s: float | None = None):
    """Apply a mixed plan on this rank (launched by torchrun with `world_size(mixed_plan)` ranks).
    The arguments are `apply`'s; returns `DataParallelLanes` or `SpanningLane`, each with
    `local_batch`, `train_step`, `global_losses`, `close`, its `label` and every rank's `labels`."""
    device = init_distributed(backend, timeout_s)
    check_mixed(mixed_plan, target(dist.get_backend()))
    check_world(mixed_plan, dist.get_world_size(), "the ranks launched")
    labels = rank_labels(mixed_plan)
    label = labels[dist.get_rank()]
    if data_parallel(mixed_plan):
        plan = executed_plan(mixed_plan, label.lane)
        par = apply(plan, build_model, optimizer, _weighted(loss_fn, loss_weight(mixed_plan, label)),
                    tp_plan=tp_plan, blocks=blocks, seed=seed, backend=backend, timeout_s=timeout_s)
        return DataParallelLanes(par, mixed_plan, label, labels, summary(mixed_plan))
    return _spanning(mixed_plan, labels, label, build_model, optimizer, loss_fn, tp_plan, blocks, seed, device)


def _spanning(mixed_plan, labels, label, build_model, optimizer, loss_fn, tp_plan, blocks, seed,
              device) -> SpanningLane:
    (lane,) = mixed_plan.lanes  # check_mixed: a spanning lane is the plan's only lane
    stages = stage_ranks(lane)
    tp = len(stages[label.stage])
    plan = lane.plan.with_(tp=tp)  # this stage's knobs
    model = build_skeleton(build_model)
    block_list = (blocks or _default_blocks)(model)
    tp_map = resolve_tp_plan(model, tp_plan(model) if callable(tp_plan) else tp_plan) \
        if tp > 1 and tp_plan is not None else {}
    check_supported(plan, dist.get_backend(), model_layout(model, block_list, tp_map))
    if tied_names(model):
        raise PlanError(SPLIT_TIES)
    # every rank creates every stage's group (new_group is a collective of the world)
    groups = [dist.new_group(ranks) for ranks in stages]
    layout = forward_layout(model, block_list)
    unsaved = unsaved_buffers(model)
    (part,) = cut_stages(model, block_list, lane.plan, label.stage, layout)
    held = held_blocks(part, layout)
    del model
    torch.manual_seed(seed + 1 + label.stage)  # dropout: the same on tp peers
    if tp > 1:
        mesh = DeviceMesh.from_group(groups[label.stage], device.type)
        apply_tp(part, mesh, tp_map, [c._modules[k] for c, k in held], False, layout)
    apply_ac([held], [label.stage], lane.plan)
    compile_blocks([c._modules[k] for c, k in held], lane.plan)
    source = build_source(build_model, seed)
    materialise([part], source, unsaved, device, False)
    del source
    opt = optimizer(list(part.parameters()))
    return SpanningLane(summary(mixed_plan), lane.plan, label, labels, stages, part, opt, loss_fn, device, groups)


def preflight_mixed(mixed_plan, model_file, model_args: dict, backend: str | None = None) -> None:
    """Raise PlanError, before any process starts, when a rank of `apply_mixed` would: what the executor
    cannot run of a mixed plan, then each lane's (each segment's) plan laid out on this model as
    `preflight` lays out a homogeneous one."""
    check_mixed(mixed_plan, target(backend))
    if data_parallel(mixed_plan):
        plans = [executed_plan(mixed_plan, i) for i in range(len(mixed_plan.lanes))]
    else:
        plans = [lane.segment_plan(seg) for lane in mixed_plan.lanes for seg in lane.segments]
        if tied_names(model_file.build(**model_args)):
            raise PlanError(SPLIT_TIES)
    for plan in plans:
        preflight(plan, model_file, model_args, backend)
