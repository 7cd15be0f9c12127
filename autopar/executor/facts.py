"""What the executor knows of a run, as `autopar.capability` reads it: the model's layout facts
(found on the meta device, before any process group exists) and the device's."""

from __future__ import annotations

import torch
from torch import nn

from autopar.capability import Device, Layout
from autopar.executor.limits import model_limits


def model_layout(model: nn.Module, blocks: nn.ModuleList | None, tp_map: dict | None, name: str = "") -> Layout:
    """The layout facts of a model built on the meta device: its limits (executor/limits.py), its
    experts, its blocks and its tensor-parallel plan (`tp_map`: resolved, None: none was given)."""
    name = name or type(model).__name__
    note = (f"no tp_plan was given for {name}; pass tp_plan=... or use a plan with tp=1" if tp_map is None else
            f"{name} has no (non-empty) tp_plan; use a plan with tp=1")
    moe = any(callable(getattr(m, "moe_shape", None)) for m in model.modules())
    return Layout(name=name, limits=model_limits(model, blocks, tp_map or {}), moe=moe, tp_plan=bool(tp_map),
                  tp_note=note, blocks=blocks is not None)


def device_facts(device: torch.device) -> Device:
    """What fp8's rules read of the device this rank runs on."""
    if device.type != "cuda":
        return Device(device.type)
    return Device("cuda", torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
