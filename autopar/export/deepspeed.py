"""The DeepSpeed config JSON for a plan (keys as documented at deepspeed.ai/docs/config-json).

The batch keys satisfy DeepSpeed's identity train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel world size. Tensor and pipeline degrees are not
config keys in DeepSpeed (AutoTP's `tensor_parallel.autotp_size` aside): pipeline parallelism is
a `PipelineModule(num_stages=...)` in the training script."""

from __future__ import annotations

import json

from autopar.export import Export, default_of, grad_elements, listed
from autopar.plan import Plan


def config(plan: Plan) -> dict:
    zero = {"stage": plan.zero, "reduce_bucket_size": grad_elements(plan),
            "allgather_bucket_size": grad_elements(plan), "overlap_comm": True, "contiguous_gradients": True}
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.dp_replicate > 1 and plan.zero == 3:  # MiCS: ZeRO-3 within groups of dp / replicas, replicated across
        zero["mics_shard_size"] = plan.dp // plan.dp_replicate
    out = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": zero,
        "communication_data_type": plan.grad_comm_dtype,
    }
    if plan.precision != "fp32":  # fp8 trains on bf16 weights; its linears are the script's (unexpressed)
        out["bf16" if plan.precision == "fp8" else plan.precision] = {"enabled": True}
    if plan.tp > 1:
        out["tensor_parallel"] = {"autotp_size": plan.tp}
    return out


# what the config expresses (`config`; dp through the batch identity, tp as AutoTP's size)
MAPS = ("precision", "tp", "dp", "dp_replicate", "micro_batch_size", "num_micro_batches", "zero", "bucket_mb",
        "grad_comm_dtype", "offload_optimizer")


def _pp(plan: Plan) -> str | None:
    return (f"pp={plan.pp}: build deepspeed.pipe.PipelineModule(num_stages={plan.pp}) in the script"
            if plan.pp > 1 else None)


UNEXPRESSED = {  # knob -> the line where the DeepSpeed config cannot express its value
    "dp_replicate": lambda p: (f"dp_replicate={p.dp_replicate} with zero={p.zero}: DeepSpeed shards within groups "
                               "(MiCS, mics_shard_size) under ZeRO-3 only; hpZ (zero_hpz_partition_size) keeps a "
                               "secondary weight copy, not HSDP" if p.dp_replicate > 1 and p.zero != 3 else None),
    "fp8_recipe": lambda p: (f"precision=fp8 ({p.fp8_recipe}): not a DeepSpeed config key; convert the linears in "
                             "the script (torchao convert_to_float8_training or Transformer Engine); exported as bf16"
                             if p.precision == "fp8" else None),
    "compile": lambda p: "compile: DeepSpeed's engine.compile() in the script" if p.compile else None,
    "cuda_graphs": lambda p: ("cuda_graphs: not a DeepSpeed training config key; engine.compile(mode="
                              "'reduce-overhead') in the script" if p.cuda_graphs else None),
    "pp": _pp,
    "schedule": lambda p: (f"schedule={p.schedule}: DeepSpeed's pipeline engine runs its own 1F1B-style schedule"
                           if p.pp > 1 and p.schedule != "1f1b" else None),
    "recompute": lambda p: (f"recompute={p.recompute}: wrap blocks with deepspeed.checkpointing.checkpoint in the "
                            "script" if p.recompute != "none" else None),
    "sequence_parallel": lambda p: ("sequence_parallel: Megatron-style sequence parallelism is not a DeepSpeed "
                                    "config key" if p.sequence_parallel else None),
    "cp": lambda p: (f"cp={p.cp}: DeepSpeed has no ring-attention context parallelism (its Ulysses "
                     "sequence_parallel_size splits heads with all-to-alls, another scheme)" if p.cp > 1 else None),
    "ep": lambda p: (f"ep={p.ep}: DeepSpeed-MoE takes the expert-parallel size in the model code "
                     f"(deepspeed.moe.layer.MoE(..., ep_size={p.ep})), not in the config" if p.ep > 1 else None),
    "mesh_order": lambda p: (f"mesh_order={','.join(p.mesh_order)}: the rank layout comes from the script's process "
                             "groups" if tuple(p.mesh_order) != default_of("mesh_order") else None),
    "stage_recompute": lambda p: (f"stage_recompute={','.join(p.stage_recompute)}: wrap each stage's blocks "
                                  "with deepspeed.checkpointing.checkpoint in the script ('full:K': its first K)"
                                  if any(e != "none" for e in p.stage_recompute) else None),
    "layer_split": lambda p: (f"layer_split={list(p.layer_split)}: pass PipelineModule(partition_method=...) in the "
                              "script" if p.layer_split else None),
}


def unexpressed(plan: Plan) -> list[str]:
    return listed(UNEXPRESSED, plan)


def export(plan: Plan) -> Export:
    return Export("deepspeed", json.dumps(config(plan), indent=2) + "\n", tuple(unexpressed(plan)))
