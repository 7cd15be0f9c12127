"""An HF accelerate config file (YAML, what `accelerate launch --config_file` reads) for a plan:
the Megatron-LM plugin when the plan has tensor or pipeline parallelism, the FSDP plugin (FSDP2)
for ZeRO 1-3, plain multi-GPU DDP otherwise."""

from __future__ import annotations

from autopar.export import Export, covering_recompute, default_of, listed
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
            "megatron_lm_recompute_activations": _recomputes(plan),
            "megatron_lm_use_distributed_optimizer": plan.zero >= 1}
    elif plan.zero:
        out["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": plan.zero == 3,
            "fsdp_offload_params": plan.offload_optimizer,
            "fsdp_activation_checkpointing": _recomputes(plan),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    return out


# what the config expresses (`config`; dp through num_processes, the rest under its plugin)
MAPS = ("precision", "tp", "pp", "dp", "num_micro_batches", "sequence_parallel", "recompute", "zero",
        "offload_optimizer")


def _recomputes(plan: Plan) -> bool:
    """Whether any stage recomputes (the config has one switch for every stage)."""
    return (covering_recompute(plan)[0] if plan.stage_recompute else plan.recompute) != "none"


def _megatron(plan: Plan) -> bool:
    return plan.tp > 1 or plan.pp > 1


def _zero(plan: Plan) -> str | None:
    if not _megatron(plan) and plan.zero == 1:
        return "zero=1: the FSDP plugin also shards gradients (exported as ZeRO-2)"
    if _megatron(plan) and plan.zero >= 2:
        return f"zero={plan.zero}: the Megatron plugin shards optimizer states only (distributed optimizer)"
    return None


def _recompute(plan: Plan) -> str | None:
    if _megatron(plan):
        return (f"recompute={plan.recompute}: the plugin's recompute_activations is Megatron's selective recompute"
                if plan.recompute != "none" else None)
    if plan.recompute == "full":
        return f"recompute_blocks={plan.recompute_blocks}: FSDP activation checkpointing wraps every block"
    if plan.recompute == "selective":
        return "recompute=selective: FSDP activation checkpointing recomputes whole blocks"
    return None


UNEXPRESSED = {  # knob -> the line where the accelerate config cannot express its value
    "dp_replicate": lambda p: (f"dp_replicate={p.dp_replicate}: the config file has no HSDP key (set "
                               f"ParallelismConfig(dp_replicate_size={p.dp_replicate}, dp_shard_size="
                               f"{p.dp // p.dp_replicate}) in the script)" if p.dp_replicate > 1 else None),
    "cp": lambda p: (f"cp={p.cp}: the config file has no context-parallel key (set ParallelismConfig(cp_size={p.cp}) "
                     "in the script: accelerate's context-parallel guide, FSDP2)" if p.cp > 1 else None),
    "ep": lambda p: (f"ep={p.ep}: the config file has no expert-parallel key (shard the experts in the script)"
                     if p.ep > 1 else None),
    "num_micro_batches": lambda p: (f"micro-batches: Accelerator(gradient_accumulation_steps={p.num_micro_batches}) "
                                    f"and a DataLoader batch of {p.micro_batch_size} in the script"
                                    if not _megatron(p) else None),
    "micro_batch_size": lambda p: (f"micro_batch_size={p.micro_batch_size}: the DataLoader batch in the script"
                                   if _megatron(p) else None),
    "zero": _zero,
    "recompute": _recompute,
    "schedule": lambda p: (f"schedule={p.schedule}: the Megatron plugin runs 1F1B"
                           if _megatron(p) and (p.schedule != "1f1b" or p.virtual_stages > 1) else None),
    "offload_optimizer": lambda p: ("offload_optimizer: the Megatron plugin has no optimizer offload key"
                                    if _megatron(p) and p.offload_optimizer else None),
    "fp8_recipe": lambda p: (f"fp8_recipe={p.fp8_recipe}: the config names mixed_precision fp8 only; pass the recipe "
                             "in the script (accelerate's TERecipeKwargs or AORecipeKwargs)"
                             if p.precision == "fp8" else None),
    "compile": lambda p: ("compile: accelerate's dynamo_config compiles the whole model; compile each block in the "
                          "script" if p.compile else None),
    "cuda_graphs": lambda p: ("cuda_graphs: dynamo_config's dynamo_mode reduce-overhead compiles the whole model; "
                              "compile each block with mode='reduce-overhead' in the script" if p.cuda_graphs
                              else None),
    "grad_comm_dtype": lambda p: (f"grad_comm_dtype={p.grad_comm_dtype}: not an accelerate config key"
                                  if p.grad_comm_dtype != "fp32" and p.dp > 1 else None),
    "bucket_mb": lambda p: (f"bucket_mb={p.bucket_mb:g}: pass DistributedDataParallelKwargs(bucket_cap_mb=...) in the "
                            "script" if p.bucket_mb != default_of("bucket_mb") else None),
    "mesh_order": lambda p: (f"mesh_order={','.join(p.mesh_order)}: not an accelerate config key"
                             if tuple(p.mesh_order) != default_of("mesh_order") else None),
    "stage_recompute": lambda p: (f"stage_recompute={','.join(p.stage_recompute)}: the config has one recompute "
                                  "switch for every stage (exported on)" if _recomputes(p) else None),
    "layer_split": lambda p: (f"layer_split={list(p.layer_split)}: the Megatron plugin splits evenly"
                              if p.layer_split else None),
}


def unexpressed(plan: Plan) -> list[str]:
    return ["num_machines: set it to your node count (the plan knows only the world size)", *listed(UNEXPRESSED, plan)]


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
