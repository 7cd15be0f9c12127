"""Megatron-LM command-line arguments for a plan.

The values are kept as megatron-core config fields first (`core_fields`), so the tests can build
megatron-core's own `ModelParallelConfig` and `DistributedDataParallelConfig` from exactly what
the arguments say; each field has one Megatron-LM flag (`FLAGS`)."""

from __future__ import annotations

import shlex

from autopar.capability import ZERO_BUBBLE
from autopar.export import Export, covering_recompute, default_of, grad_elements, listed
from autopar.knobs import stage_full_blocks
from autopar.plan import Plan

# megatron-core field -> Megatron-LM flag (training/arguments.py); booleans are store_true flags
FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
    "sequence_parallel": "--sequence-parallel",
    "bf16": "--bf16",
    "fp16": "--fp16",
    "use_distributed_optimizer": "--use-distributed-optimizer",
    "num_distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "bucket_size": "--ddp-bucket-size",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "optimizer_cpu_offload": "--optimizer-cpu-offload",
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "fp8": "--fp8-format",
    "fp8_recipe": "--fp8-recipe",
    "enable_cuda_graph": "--enable-cuda-graph",
}
# autopar's fp8 recipe -> Transformer Engine's as Megatron names it (rowwise has no TE counterpart)
FP8_RECIPES = {"tensorwise": "tensorwise", "mxfp8": "mxfp8"}
MODEL_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "sequence_parallel", "bf16", "fp16")
DDP = ("use_distributed_optimizer", "num_distributed_optimizer_instances", "bucket_size", "grad_reduce_in_fp32")


def core_fields(plan: Plan) -> dict:
    """The plan as megatron-core config fields (ModelParallelConfig, DistributedDataParallelConfig,
    OptimizerConfig, TransformerConfig's recompute and layout fields); None: left at Megatron's default."""
    recompute, blocks = _recompute_setting(plan)
    stages = layout(plan)
    return {
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
        "context_parallel_size": plan.cp if plan.cp > 1 else None,
        "expert_model_parallel_size": plan.ep if plan.ep > 1 else None,
        # Megatron-LM takes the layout or the virtual stages per rank, not both (the layout says it)
        "virtual_pipeline_model_parallel_size": plan.virtual_stages if plan.virtual_stages > 1 and not stages else None,
        "pipeline_model_parallel_layout": stages,
        "sequence_parallel": plan.sequence_parallel,
        "bf16": plan.precision in ("bf16", "fp8"),  # fp8 trains on bf16 weights
        "fp16": plan.precision == "fp16",
        "use_distributed_optimizer": plan.zero in (1, 2),
        # HSDP with the distributed optimizer: its states sharded within dp x cp / instances ranks (the
        # partial DistOpt), the instances all-reducing the gradient shards
        "num_distributed_optimizer_instances": plan.dp_replicate if plan.dp_replicate > 1 and plan.zero in (1, 2)
        else None,
        "bucket_size": grad_elements(plan) if plan.bucket_mb != default_of("bucket_mb") else None,
        "grad_reduce_in_fp32": plan.grad_comm_dtype == "fp32" and plan.precision != "fp32",
        "optimizer_cpu_offload": plan.offload_optimizer,
        "recompute_granularity": None if recompute == "none" else recompute,
        "recompute_method": "block" if recompute == "full" else None,
        "recompute_num_layers": blocks if recompute == "full" else None,
        "fp8": "hybrid" if plan.precision == "fp8" else None,  # e4m3 forward, e5m2 gradients
        "fp8_recipe": FP8_RECIPES.get(plan.fp8_recipe) if plan.precision == "fp8" else None,
        "enable_cuda_graph": plan.cuda_graphs,  # TransformerConfig: Megatron-Core's per-layer CUDA graphs
    }


def layout(plan: Plan) -> str | None:
    """Megatron-Core's `pipeline_model_parallel_layout` of an explicit split (None: balanced, or no
    pipeline): one '|'-separated entry per virtual stage in pipeline order, 'E' the embedding on
    the first, 't' a transformer layer, 'L' the loss (with the final norm and output layer) on the
    last, e.g. "E|t*3|t*3|t*2,L" for layer_split (0, 3, 3, 2). It replaces the first/last-stage
    layer-count flags (`--decoder-first/last-pipeline-num-layers`), which it excludes."""
    if not plan.layer_split or plan.pp == 1:
        return None
    last = len(plan.layer_split) - 1

    def stage(i: int, blocks: int) -> str:
        layers = "t" * blocks if blocks < 2 else f"t*{blocks}"
        return ("E" if i == 0 else "") + layers + (("," if layers else "") + "L" if i == last else "")
    return "|".join(stage(i, n) for i, n in enumerate(plan.layer_split))


def _recompute_setting(plan: Plan) -> tuple[str, int]:
    """(granularity, blocks per virtual stage) for Megatron, which counts per virtual stage and gives
    every stage the same setting: a per-stage plan's covering one (`_stage_recompute` says when
    that is not exact)."""
    if plan.stage_recompute:
        return covering_recompute(plan)
    return plan.recompute, max(plan.recompute_blocks // plan.virtual_stages, 1)


def arguments(plan: Plan) -> list[str]:
    args = ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch)]
    for name, value in core_fields(plan).items():
        if value is True:
            args.append(FLAGS[name])
        elif value not in (None, False):
            args += [FLAGS[name], shlex.quote(str(value))]  # the layout's '|' and '*' are shell syntax
    if plan.zero == 3:
        args.append("--use-torch-fsdp2")
    return args


# what the arguments express (`core_fields`, the batch flags; dp is the world size over the other degrees)
MAPS = ("precision", "tp", "pp", "cp", "dp", "ep", "dp_replicate", "micro_batch_size", "num_micro_batches", "zero",
        "recompute", "bucket_mb", "schedule", "sequence_parallel", "grad_comm_dtype", "offload_optimizer", "fp8_recipe",
        "cuda_graphs", "layer_split")


def _recompute(plan: Plan) -> str | None:
    if plan.recompute == "full" and plan.recompute_blocks % plan.virtual_stages:
        per_stage = max(plan.recompute_blocks // plan.virtual_stages, 1)
        return (f"recompute_blocks={plan.recompute_blocks}: Megatron counts blocks per virtual stage "
                f"({plan.virtual_stages} per rank); exported as {per_stage}")
    return None


def _stage_recompute(plan: Plan) -> str | None:
    """Megatron's recompute_num_layers recomputes the first N blocks of every virtual stage (all of a
    stage with fewer): a per-stage plan is exact when each stage holding blocks asks just that."""
    if not plan.stage_recompute:
        return None
    mode, n = covering_recompute(plan)
    split = plan.layer_split or (None,) * len(plan.stage_recompute)
    held = [(e, b) for e, b in zip(plan.stage_recompute, split) if b != 0]  # a stage of no block recomputes nothing
    exact = (all(stage_full_blocks(e) == (n if b is None else min(n, b)) for e, b in held) if mode == "full"
             else all(e == mode for e, _ in held))
    if exact:
        return None
    said = (f"full recompute of {n} block{'s' * (n != 1)} per stage" if mode == "full"
            else f"{mode} recompute in every stage")
    return (f"stage_recompute={','.join(plan.stage_recompute)}: Megatron gives every stage the same recompute "
            f"(recompute_num_layers per virtual stage); exported as {said}")


UNEXPRESSED = {  # knob -> the line where Megatron-LM cannot express its value
    "dp_replicate": lambda p: (f"dp_replicate={p.dp_replicate} with zero=3: Megatron's torch FSDP2 shards over all "
                               "of dp (num_distributed_optimizer_instances applies to the distributed optimizer, "
                               "zero 1 or 2)"
                               if p.dp_replicate > 1 and p.zero == 3 else None),
    "schedule": lambda p: ("schedule=gpipe: Megatron runs 1F1B or interleaved 1F1B only" if p.schedule == "gpipe" else
                           f"schedule={p.schedule}: Megatron-Core has no zero-bubble or DualPipe schedule (exported as "
                           f"{'interleaved 1F1B' if p.virtual_stages > 1 else '1F1B'})" if p.schedule in ZERO_BUBBLE
                           else None),
    "zero": lambda p: ("zero=2: the distributed optimizer shards optimizer states, not the gradient buffer (ZeRO-1 "
                       "memory)") if p.zero == 2 else None,
    "recompute": _recompute,
    "offload_optimizer": lambda p: ("offload_optimizer with zero=3: Megatron offloads the distributed optimizer only"
                                    if p.offload_optimizer and p.zero == 3 else None),
    "grad_comm_dtype": lambda p: ("grad_comm_dtype=fp16: Megatron reduces in the training dtype or fp32"
                                  if p.grad_comm_dtype == "fp16" and p.precision == "bf16" else None),
    "mesh_order": lambda p: (f"mesh_order={','.join(p.mesh_order)}: Megatron's rank order is tp innermost, then cp, "
                             f"dp, pp" if tuple(p.mesh_order) != default_of("mesh_order") else None),
    "stage_recompute": _stage_recompute,
    "fp8_recipe": lambda p: (f"fp8_recipe={p.fp8_recipe}: Transformer Engine has no per-row scaling (exported with "
                             "Megatron's default recipe)" if p.precision == "fp8" and p.fp8_recipe not in FP8_RECIPES
                             else None),
    "compile": lambda p: "compile: Megatron-Core runs Transformer Engine's fused kernels, not torch.compile" if p.compile
    else None,
}


def unexpressed(plan: Plan) -> list[str]:
    return listed(UNEXPRESSED, plan)


def export(plan: Plan) -> Export:
    return Export("megatron", " ".join(arguments(plan)) + "\n", tuple(unexpressed(plan)))
