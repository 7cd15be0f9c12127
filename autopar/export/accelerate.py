"""An HF accelerate config file (YAML, what `accelerate launch --config_file` reads) for a plan:
the Megatron-LM plugin when the plan has tensor or pipeline parallelism, the FSDP plugin (FSDP2)
for ZeRO 1-3, plain multi-GPU DDP otherwise."""

from __future__ import annotations

from autopar.export import Export, default_of
from autopar.plan import Plan

MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", "fp8": "fp8"}  # fp8: Accelerate's FP8 (TE / torchao)


def config(plan: Plan) -> dict:
    megatron = plan.tp > 1 or plan.pp > 1
    out = {"compute_environment": "LOCAL_MACHINE",
           "distributed_type": "MEGATRON_LM" if megatron else ("FSDP" if plan.zero else "MULTI_GPU"),
           "mixed_precision": MIXED[plan.precision], "num_processes": plan.world_size, "num_machines": 1,
           "machine_rank": 0, "use_cpu": False}
    if megatron:
        out["megatron_lm_config"] = {
            "megatron_lm_tp_degree": plan.tp, "megatron_lm_pp_degree": plan.pp,
            "megatron_lm_num_micro_batches": plan.num_micro_batches,
            "megatron_lm_sequence_parallelism": plan.sequence_parallel,
            "megatron_lm_recompute_activations": plan.recompute != "none",
            "megatron_lm_use_distributed_optimizer": plan.zero >= 1}
    elif plan.zero:
        out["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": plan.zero == 3,
            "fsdp_offload_params": plan.offload_optimizer,
            "fsdp_activation_checkpointing": plan.recompute != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    return out


def unexpressed(plan: Plan) -> list[str]:
    megatron = plan.tp > 1 or plan.pp > 1
    out = ["num_machines: set it to your node count (the plan knows only the world size)"]
    if plan.cp > 1:
        out.append(f"cp={plan.cp}: the config file has no context-parallel key (set "
                   f"ParallelismConfig(cp_size={plan.cp}) in the script: accelerate's context-parallel guide, FSDP2)")
    if plan.ep > 1:
        out.append(f"ep={plan.ep}: the config file has no expert-parallel key (shard the experts in the script)")
    if not megatron:
        out.append(f"micro-batches: Accelerator(gradient_accumulation_steps={plan.num_micro_batches}) and a "
                   f"DataLoader batch of {plan.micro_batch_size} in the script")
        if plan.zero == 1:
            out.append("zero=1: the FSDP plugin also shards gradients (exported as ZeRO-2)")
        if plan.recompute == "full":
            out.append(f"recompute_blocks={plan.recompute_blocks}: FSDP activation checkpointing wraps every block")
        if plan.recompute == "selective":
            out.append("recompute=selective: FSDP activation checkpointing recomputes whole blocks")
    else:
        out.append(f"micro_batch_size={plan.micro_batch_size}: the DataLoader batch in the script")
        if plan.recompute != "none":
            out.append(f"recompute={plan.recompute}: the plugin's recompute_activations is Megatron's selective "
                       "recompute")
        if plan.zero >= 2:
            out.append(f"zero={plan.zero}: the Megatron plugin shards optimizer states only (distributed optimizer)")
        if plan.schedule != "1f1b" or plan.virtual_stages > 1:
            out.append(f"schedule={plan.schedule}: the Megatron plugin runs 1F1B")
    if plan.grad_comm_dtype != "fp32" and plan.dp > 1:
        out.append(f"grad_comm_dtype={plan.grad_comm_dtype}: not an accelerate config key")
    if plan.bucket_mb != default_of("bucket_mb"):
        out.append(f"bucket_mb={plan.bucket_mb:g}: pass DistributedDataParallelKwargs(bucket_cap_mb=...) in the script")
    if tuple(plan.mesh_order) != default_of("mesh_order"):
        out.append(f"mesh_order={','.join(plan.mesh_order)}: not an accelerate config key")
    return out


def to_yaml(d: dict, indent: int = 0) -> str:
    """Mappings of scalars, nested: all an accelerate config needs (no YAML library required)."""
    lines = []
    for key, value in d.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(to_yaml(value, indent + 2))
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            lines.append(" " * indent + f"{key}: {text}")
    return "\n".join(lines)


def export(plan: Plan) -> Export:
    return Export("accelerate", to_yaml(config(plan)) + "\n", tuple(unexpressed(plan)))
