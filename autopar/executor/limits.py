"""What the executor cannot run for one model's layout, found once by the profiler.

The limits travel in the model profile as data (`ModelProfile.limits`); `autopar/capability.py`
turns them into the choices the plan space offers and the checks `Plan.validate` makes.
"""

from __future__ import annotations

from torch import nn

from autopar.executor.expert_parallel import moe_experts
from autopar.layout import forward_layout
from autopar.modelfile import sequence_parallel_styles


def model_limits(model: nn.Module, blocks: nn.ModuleList | None, tp_plan: dict) -> dict[str, str]:
    """{knob: why the executor cannot do it for this model}: ``pp`` (pipeline parallelism),
    ``sp`` (sequence parallelism), ``sp_off`` (tensor parallelism without it), ``ep`` (expert
    parallelism: MoE layers whose experts are not stacked as the zoo's `GroupedExperts`) and ``cp``
    (context parallelism)."""
    limits = {}
    layers = [m for m in model.modules() if callable(getattr(m, "moe_shape", None))]
    if layers and len(moe_experts(model)) < len(layers):
        limits["ep"] = ("expert parallelism shards experts stacked as w1/w2/w3 (autopar.zoo.moe.GroupedExperts); "
                        "this model's MoE layers hold them otherwise: use ep 1")
    layout = forward_layout(model, blocks)  # the forward's order, not module names
    if layout.pp_problem:
        limits["pp"] = layout.pp_problem
    if not getattr(model, "sequence_shardable", False):
        limits["cp"] = ("context parallelism needs the model to take its token positions and attention from "
                        "autopar.zoo's sequence helpers (token_positions, causal_sdpa / context_keys) and to say so "
                        "with sequence_shardable = True (the bundled GPT, Llama and BERT do); use cp=1")
    styles_sp = sequence_parallel_styles(tp_plan)
    if styles_sp is True:
        limits["sp_off"] = ("the tp_plan's ParallelStyles shard the sequence (SequenceParallel), so tensor "
                            "parallelism runs with sequence parallelism on")
    elif styles_sp is False:
        limits["sp"] = "the tp_plan's ParallelStyles do not shard the sequence (no SequenceParallel entry)"
    elif tp_plan and layout.sp_problem:
        limits["sp"] = layout.sp_problem
    return limits
