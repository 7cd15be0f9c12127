"""Compute precision: autocast for bf16/fp16, and loss scaling for fp16.

The loss scaler is `ShardedGradScaler` over the whole world: tensor-, pipeline- and
ZeRO-sharded gradients differ between ranks, and every rank must skip a step together when
any of them overflowed, which the plain `GradScaler` does not ensure.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from autopar.plan import Plan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(plan: Plan, device: torch.device):
    """The forward's autocast context (a no-op in fp32)."""
    if plan.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[plan.precision])


def grad_scaler(plan: Plan, device: torch.device) -> ShardedGradScaler | None:
    """A world-wide loss scaler for fp16, None otherwise."""
    if plan.precision != "fp16":
        return None
    scaler = ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
    # make the scale now: pipeline ranks before the last stage never scale a loss themselves
    scaler.scale(torch.ones((), device=device))
    return scaler
