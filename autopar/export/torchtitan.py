"""torchtitan (0.3) command-line overrides for a plan: the `--section.key value` arguments its
ConfigManager reads after `--module M --config C` (torchtitan 0.3 has no job TOML).

Data parallelism maps to torchtitan's two dp degrees: DDP (zero 0) is `replicate`, FSDP2 is
`shard`, and FSDP2 that keeps parameters gathered after forward (`fsdp_reshard_after_forward
never`) is ZeRO-2. The local batch is per data-parallel rank: the micro-batch without pipeline
parallelism (torchtitan accumulates global / (local x dp) steps), all micro-batches with it."""

from __future__ import annotations

from autopar.export import Export, default_of
from autopar.plan import Plan

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}  # torch.distributed.pipelining
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}  # fp8 trains on bf16 weights


def overrides(plan: Plan) -> list[str]:
    sharded = plan.zero >= 1
    args = [
        "--parallelism.data_parallel_replicate_degree", str(1 if sharded else plan.dp),
        "--parallelism.data_parallel_shard_degree", str(plan.dp if sharded else 1),
        "--parallelism.tensor_parallel_degree", str(plan.tp),
        "--parallelism.pipeline_parallel_degree", str(plan.pp),
        "--parallelism.context_parallel_degree", str(plan.cp),
        "--training.global_batch_size", str(plan.global_batch),
    ]
    if plan.ep > 1:  # experts over ep ranks borrowed from dp_shard x cp, as torchtitan's MoE does
        args += ["--parallelism.expert_parallel_degree", str(plan.ep)]
    if plan.zero in (1, 2):
        args += ["--parallelism.fsdp_reshard_after_forward", "never"]
    if plan.tp > 1:
        args.append("--parallelism." + ("" if plan.sequence_parallel else "no-") + "enable_sequence_parallel")
    if plan.pp > 1:
        args += ["--parallelism.pipeline_parallel_schedule", SCHEDULES[plan.schedule],
                 "--parallelism.pipeline_parallel_microbatch_size", str(plan.micro_batch_size),
                 "--training.local_batch_size", str(plan.micro_batch_size * plan.num_micro_batches),
                 "--training.disable_cuda_graphs"]  # torchtitan refuses CUDA graphs with pipelining
    else:
        args += ["--training.local_batch_size", str(plan.micro_batch_size)]
    if plan.precision in DTYPES:
        args += ["--training.mixed_precision_param", DTYPES[plan.precision]]
    if plan.offload_optimizer:
        args.append("--training.enable_cpu_offload")
    if plan.precision == "fp8":  # torchtitan's model converters: torchao float8, or MX on Blackwell
        args += (["--model.converters", "mx", "--mx.recipe_name", "mxfp8"] if plan.fp8_recipe == "mxfp8"
                 else ["--model.converters", "float8", "--float8.recipe_name", plan.fp8_recipe])
    if plan.compile:
        args.append("--compile.enable")
    args.append("activation_checkpoint:" + plan.recompute)  # a tyro subcommand: none | selective | full
    return args


def unexpressed(plan: Plan) -> list[str]:
    out = []
    if plan.zero == 1:
        out.append("zero=1: torchtitan's FSDP2 also shards gradients (exported as ZeRO-2)")
    if plan.cp > 1 and plan.zero == 0:
        out.append(f"cp={plan.cp} with zero=0: torchtitan applies FSDP2 over dp_shard x cp whenever cp > 1 "
                   "(the weights are sharded over the cp ranks)")
    if plan.precision == "fp16":
        out.append("precision=fp16: torchtitan trains in bfloat16 or float32 (exported as bfloat16 defaults)")
    if plan.grad_comm_dtype != "fp32" and plan.dp > 1:
        out.append(f"grad_comm_dtype={plan.grad_comm_dtype}: torchtitan reduces gradients in float32")
    if plan.bucket_mb != default_of("bucket_mb"):
        out.append(f"bucket_mb={plan.bucket_mb:g}: torchtitan has no bucket-size setting")
    if plan.recompute == "full":
        out.append(f"recompute_blocks={plan.recompute_blocks}: torchtitan's full AC checkpoints every block")
    if plan.recompute == "selective":
        out.append("recompute=selective: torchtitan's selective AC is op-level (saves matmuls), not the attention "
                   "core alone")
    if plan.virtual_stages > 2:
        out.append(f"virtual_stages={plan.virtual_stages}: torchtitan runs 2 stages per rank unless "
                   f"--parallelism.pipeline_parallel_layers_per_stage is the model's blocks / {plan.stages}")
    if tuple(plan.mesh_order) != default_of("mesh_order"):
        out.append(f"mesh_order={','.join(plan.mesh_order)}: torchtitan's mesh is pp, dp, cp, tp (tp innermost)")
    if plan.layer_split:
        out.append(f"layer_split={list(plan.layer_split)}: set --parallelism.module_fqns_per_model_part by hand")
    return out


def export(plan: Plan) -> Export:
    return Export("torchtitan", " ".join(overrides(plan)) + "\n", tuple(unexpressed(plan)))
