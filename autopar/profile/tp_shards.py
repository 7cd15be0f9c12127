"""Does the forward run on a tensor-parallel rank's shards? Asked on the meta device by the profiler.

A column-wise linear whose output stays sharded (style ``colwise``, or a ``ColwiseParallel`` with a
local output) hands each tp rank out_features / tp features. Code that cuts those features by sizes
from the config, as a fused q/k/v projection split with ``split([q, kv, kv])`` does, fails there on
every rank at the first step (``split_with_sizes expects split_sizes to sum exactly to ...``),
although the whole model profiles fine. The shapes are known at planning time: the profiler runs the
forward once more (no backward, the representative blocks only) with each such output cut to its
shard at the smallest degree the planner could choose (one dividing the sharded features and the
attention's head counts, as the tp axis asks), and a failure is the model file's error, in one line
naming the linear whose shard broke which op, and the fix. Row-wise linears take either their whole
input or its shard, so only code between the two can fail; collectives and replicated styles keep
their shapes. A fused projection laid out per head and split after a view (`autopar/zoo/gpt.py`,
transformers' GPT-2 as `autopar.hf` rebuilds it) runs on its shards and is accepted.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.modelfile import ModelFile
from autopar.profile.recorder import storage_key

FIX = ("lay the fused projection out per head, [head, (q, k, v), head_dim] (per kv group under GQA), and "
       "split it after a view, as autopar/zoo/gpt.py does (qkv.view(b, s, -1, 3, head_dim).unbind(3)); or give "
       "q, k and v linears of their own; or leave it out of tp_plan")


def _keeps_shard(style) -> bool:
    """A column-wise style whose output stays this rank's slice of the features."""
    if isinstance(style, str):
        return style == "colwise"
    return (isinstance(style, ColwiseParallel) and style.use_local_output
            and isinstance(style.output_layouts[0], Shard))


def _takes_shard(style) -> bool:
    """A row-wise style whose input is the features' shard."""
    if isinstance(style, str):
        return style == "rowwise"
    return isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard)


def smallest_degree(sizes) -> int | None:
    """The smallest tp > 1 dividing every sharded size (None: none does)."""
    common = math.gcd(*sizes)
    return next((d for d in range(2, common + 1) if common % d == 0), None)


class _Lineage(TorchDispatchMode):
    """Which sharded linear each tensor's features come from; an op failing on one is reported as
    that linear's."""

    def __init__(self):
        super().__init__()
        self.source: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []  # storage keys stay unique while their tensors live

    def tag(self, t: torch.Tensor, name: str) -> None:
        self.source[storage_key(t)] = name
        self._keep.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        names = [self.source[k] for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and (k := storage_key(t)) in self.source]
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if names:
                raise _ShardBroken(names[0], func._overloadpacket.__name__, exc) from exc
            raise
        if names:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tag(t, names[0])
        return out


class _ShardBroken(Exception):
    def __init__(self, name: str, op: str, cause: Exception):
        super().__init__(str(cause))
        self.name, self.op, self.cause = name, op, cause


def check_tp_shards(mf: ModelFile, model: nn.Module, tp_plan: dict, run_forward, heads=()) -> None:
    """Raise ModelFileError when the forward fails with the tp_plan's column-wise outputs cut to a
    rank's shard. ``run_forward()`` runs the model's forward on meta (the profiler narrows the blocks);
    ``heads``: the attention's head counts, which every tp degree divides (65 heads never run at tp=2)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name in tp_plan}
    keep = {name: m for name, m in linears.items() if _keeps_shard(tp_plan[name])}
    take = [m for name, m in linears.items() if _takes_shard(tp_plan[name])]
    degree = smallest_degree([*(m.out_features for m in keep.values()), *heads]) if keep else None
    if degree is None:
        return
    lineage = _Lineage()

    def shard(name):
        def hook(module, args, out):
            local = out[..., :out.shape[-1] // degree]
            lineage.tag(local, name)
            return local
        return hook

    def whole(module, args):  # a row-wise linear reads its shard of the features, or all of them
        x = args[0]
        if isinstance(x, torch.Tensor) and x.shape[-1] * degree == module.in_features:
            return (x.new_empty(*x.shape[:-1], module.in_features), *args[1:])
        return None

    handles = [m.register_forward_hook(shard(name)) for name, m in keep.items()]
    handles += [m.register_forward_pre_hook(whole) for m in take]
    try:
        with torch.no_grad(), lineage:
            run_forward()
    except _ShardBroken as broken:
        out = keep[broken.name].out_features
        cause = broken.cause.with_traceback(broken.__traceback__)  # the model file's line, the op's message
        raise mf.error(f"tp_plan shards {broken.name} column-wise, and at tp={degree} its output ({out // degree} "
                       f"of {out} features per rank) breaks {broken.op}, which would fail on every rank",
                       cause, FIX) from None
    except Exception as exc:  # not an op on a shard's features: the shapes broke it all the same
        raise mf.error(f"the forward fails at tp={degree} with the column-wise outputs of {', '.join(list(keep)[:3])} "
                       "cut to a rank's shard, as on every rank", exc, FIX) from None
    finally:
        for h in handles:
            h.remove()

