"""Compute precision: autocast for bf16/fp16, loss scaling for fp16, torchao's fp8 training, and
torch.compile of the blocks.

FP8 (CUDA only; the CPU and GPUs before compute capability 8.9 are refused in one line by
`autopar.capability`) runs the blocks' linears as torchao's float8 linears (`convert_to_float8_training` with
`Float8LinearConfig.from_recipe_name("tensorwise" | "rowwise")`; MXFP8 on Blackwell through
`MXFP8TrainingOpConfig`), on the bf16 skeleton before tensor parallelism, as torchtitan does; the
output head stays bf16. The rest of the model autocasts in bf16. Under FSDP2 with tensorwise
scaling the weights are all-gathered in fp8 (`enable_fsdp_float8_all_gather`). torchao's casts
are separate kernels unless compiled: compile the blocks with fp8 (the cost model charges fp8's
gain only then). Unverified on CUDA in this repository's tests (no GPU in CI).

Autocast covers the forward and the loss only, never a backward: autocast caches the bf16/fp16
copies of the weights while it is active, and activation recompute inside a live autocast
reuses those cached copies instead of recasting, so its saved tensors no longer match the
forward's (`CheckpointError`). Pipeline schedules run forward and backward in one call, so
there the stage modules' forwards and the loss are wrapped one by one.

The loss scaler is `ShardedGradScaler` over the whole world: tensor-, pipeline- and
ZeRO-sharded gradients differ between ranks, and every rank must skip a step together when
any of them overflowed, which the plain `GradScaler` does not ensure. It unscales the local
shards of DTensor gradients: with tensor parallelism and no FSDP a rank holds DTensor and plain
gradients side by side, which one fused unscale call cannot take. With optimizer offload every
gradient shard is on the CPU, and so are the scale and the overflow check: their all-reduce runs
over a gloo group of the world, never a CPU tensor over NCCL (torch's own fallback copies the flag
to the GPU and back each step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from autopar.plan import Plan

# fp8 autocasts in bf16: only the converted linears cast their inputs to fp8 (convert_fp8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def _fp8_linear(module: nn.Module) -> bool:
    """A linear whose shapes the fp8 GEMMs take (both dimensions multiples of 16)."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_fp8(blocks: list[nn.Module], plan: Plan) -> None:
    """The blocks' linears as torchao fp8 linears, in place (nothing when the plan is not fp8)."""
    if plan.precision != "fp8":
        return
    if plan.fp8_recipe == "mxfp8":
        from torchao.prototype.moe_training.config import (  # lazy: torchao is optional, for fp8 plans only
            MXFP8TrainingOpConfig, MXFP8TrainingRecipe)
        from torchao.quantization import quantize_  # lazy: as above
        config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
        for block in blocks:
            quantize_(block, config, filter_fn=lambda m, fqn: _fp8_linear(m))
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: torchao is optional
    config = Float8LinearConfig.from_recipe_name(plan.fp8_recipe)
    if plan.zero == 3 and plan.fp8_recipe == "tensorwise":  # FSDP2 gathers the fp8 weights
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    for block in blocks:
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, fqn: _fp8_linear(m))


def compile_blocks(blocks: list[nn.Module], plan: Plan) -> None:
    """torch.compile each block in place (`Module.compile`: names, hooks and checkpoint wrappers
    kept), per block as torchtitan does: one compiled graph reused by every block of a kind. With
    `cuda_graphs`, torch.compile's own mode="reduce-overhead" (Inductor's CUDA graph trees): each
    block's kernels are captured once and replayed with one launch (CUDA only: autopar.capability)."""
    if plan.compile:
        mode = {"mode": "reduce-overhead"} if plan.cuda_graphs else {}
        for block in blocks:
            block.compile(**mode)


def autocast(plan: Plan, device: torch.device):
    """The forward's autocast context (a no-op in fp32)."""
    if plan.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[plan.precision])


def autocast_calls(fn, plan: Plan, device: torch.device):
    """`fn` run under the plan's autocast, which ends when it returns (before any backward)."""
    if plan.precision == "fp32":
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with autocast(plan, device):
            return fn(*args, **kwargs)
    return run


def autocast_forward(module: nn.Module, plan: Plan, device: torch.device) -> None:
    """Run `module`'s forward under the plan's autocast (in place: names and hooks unchanged)."""
    if plan.precision != "fp32":
        module.forward = autocast_calls(module.forward, plan, device)


class LocalShardGradScaler(ShardedGradScaler):
    """ShardedGradScaler that checks and unscales each DTensor gradient's local shard."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grads = defaultdict(list)  # (device, dtype) -> local gradients
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    local = grad._local_tensor if isinstance(grad, DTensor) else grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grads[local.device, local.dtype].append(local)
            found, inv = {}, {}
            for (device, _), tensors in grads.items():
                if device not in found:
                    found[device] = found_inf.to(device)
                    inv[device] = inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])
        # a rank holding no gradient still joins the found-inf all-reduce
        return found or {self._scale.device: found_inf}


def loss_scaler(plan: Plan, device: torch.device) -> torch.amp.GradScaler | None:
    """A one-process loss scaler for fp16 (the single-process reference), None otherwise."""
    return torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None


def grad_scaler(plan: Plan, device: torch.device) -> ShardedGradScaler | None:
    """A world-wide loss scaler for fp16, None otherwise; on the CPU when the optimizer is
    offloaded (a collective when the world is on GPUs: every rank makes the gloo group)."""
    if plan.precision != "fp16":
        return None
    home = torch.device("cpu") if plan.offload_optimizer else device
    group = dist.new_group(backend="gloo") if home.type != device.type else dist.group.WORLD
    scaler = LocalShardGradScaler(device=home.type, process_group=group)
    # make the scale now: pipeline ranks before the last stage never scale a loss themselves
    scaler.scale(torch.ones((), device=home))
    return scaler
