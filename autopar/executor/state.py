"""Distributed checkpoints (`torch.distributed.checkpoint`) that resume under another plan.

Every rank saves the parameters and optimizer state it holds under the whole model's names
(pipeline stages keep their parameters' names, FSDP2 and tensor parallel hold DTensors, the
optimizer state is flattened to one entry per parameter), so DCP can reshard on load: a run
saved under dp4 resumes under pp2·tp2 — the seed's "checkpoint hot migration".
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from autopar.executor.data_parallel import reattach
from autopar.executor.train_step import ParallelModel

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's inner module name


def _local_optimizer(par: ParallelModel) -> torch.optim.Optimizer:
    """ZeRO-1 holds this rank's shard of the optimizer in `.optim`; its keys are this rank's own."""
    opt = par.optimizer
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def _tp_specs(par: ParallelModel) -> dict[str, object]:
    """DTensor specs of parameters that DDP turned into plain local shards (DDP with TP)."""
    return {name.replace(_WRAPPER_PREFIX, ""): p._st_info for name, p in par.model.named_parameters()
            if hasattr(p, "_st_info")}


def _as_dtensors(state: dict, specs: dict, prefix: str = "") -> dict:
    """Give DCP the global view of local TP shards: wrap them (sharing storage) as DTensors."""
    out = {}
    for key, value in state.items():
        fqn = key[len(prefix):] if key.startswith(prefix) else None
        if prefix == "state.":  # flattened optimizer state: "state.<fqn>.<name>"
            fqn = fqn.rpartition(".")[0] if fqn else None
        spec = specs.get(fqn) if fqn is not None else None
        if spec is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim():
            value = DTensor.from_local(value, spec.mesh, spec.placements, run_check=False,
                                       shape=spec.shape, stride=spec.stride)
        out[key] = value
    return out


def _state(par: ParallelModel):
    reattach(par.tp_leaves)  # parameters and optimizer state must pair up by identity
    model_sd, optim_sd = get_state_dict(par.model, _local_optimizer(par), options=_OPTIONS)
    specs = _tp_specs(par)
    portable = {"model": _as_dtensors(model_sd, specs), "optim": _as_dtensors(optim_sd, specs, "state.")}
    return model_sd, optim_sd, portable


def save_checkpoint(par: ParallelModel, path, step: int) -> None:
    """Save this run's model and optimizer at `step` (a collective: every rank calls it)."""
    _, _, portable = _state(par)
    dcp.save({**portable, "step": step}, checkpoint_id=str(path))


def load_checkpoint(par: ParallelModel, path) -> int:
    """Load a checkpoint saved under any plan of the same model; returns its step."""
    model_sd, optim_sd, portable = _state(par)
    state = {**portable, "step": 0}
    dcp.load(state, checkpoint_id=str(path))  # in place: the DTensor wrappers share storage
    set_state_dict(par.model, _local_optimizer(par), model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_OPTIONS)
    return int(state["step"])
