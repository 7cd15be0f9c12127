"""torchtitan (0.3) command-line overrides for a plan: the `--section.key value` arguments its
ConfigManager reads after `--module M --config C` (torchtitan 0.3 has no job TOML).

Data parallelism maps to torchtitan's two dp degrees: DDP (zero 0) is `replicate`, FSDP2 is
`shard`, HSDP (dp_replicate > 1) both (dp_replicate replicas of dp / dp_replicate shards), and FSDP2
that keeps parameters gathered after forward (`fsdp_reshard_after_forward never`) is ZeRO-2. The
local batch is per data-parallel rank: the micro-batch without pipeline
parallelism (torchtitan accumulates global / (local x dp) steps), all micro-batches with it."""

from __future__ import annotations

from autopar.export import Export, covering_recompute, default_of, listed
from autopar.plan import Plan

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",  # torch.distributed.pipelining
             "zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}  # fp8 trains on bf16 weights


def overrides(plan: Plan) -> list[str]:
    sharded = plan.zero >= 1
    replicas = plan.dp_replicate if sharded else plan.dp  # HSDP: the replicas outermost, as torchtitan's mesh
    args = [
        "--parallelism.data_parallel_replicate_degree", str(replicas),
        "--parallelism.data_parallel_shard_degree", str(plan.dp // replicas),
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
    mode = covering_recompute(plan)[0] if plan.stage_recompute else plan.recompute
    args.append("activation_checkpoint:" + mode)  # a tyro subcommand: none | selective | full
    return args


# what the overrides express (`overrides`; dp as the replicate or shard degree)
MAPS = ("precision", "tp", "pp", "cp", "dp", "ep", "dp_replicate", "micro_batch_size", "num_micro_batches", "zero",
        "recompute", "schedule", "sequence_parallel", "offload_optimizer", "fp8_recipe", "compile")


def _recompute(plan: Plan) -> str | None:
    if plan.recompute == "full":
        return f"recompute_blocks={plan.recompute_blocks}: torchtitan's full AC checkpoints every block"
    if plan.recompute == "selective":
        return "recompute=selective: torchtitan's selective AC is op-level (saves matmuls), not the attention core alone"
    return None


UNEXPRESSED = {  # knob -> the line where torchtitan cannot express its value
    "zero": lambda p: "zero=1: torchtitan's FSDP2 also shards gradients (exported as ZeRO-2)" if p.zero == 1 else None,
    "cuda_graphs": lambda p: ("cuda_graphs: torchtitan's --compile.enable has no mode; compile the blocks with "
                              "mode='reduce-overhead' in the script" if p.cuda_graphs else None),
    "cp": lambda p: (f"cp={p.cp} with zero=0: torchtitan applies FSDP2 over dp_shard x cp whenever cp > 1 (the weights "
                     "are sharded over the cp ranks)" if p.cp > 1 and p.zero == 0 else None),
    "precision": lambda p: ("precision=fp16: torchtitan trains in bfloat16 or float32 (exported as bfloat16 defaults)"
                            if p.precision == "fp16" else None),
    "grad_comm_dtype": lambda p: (f"grad_comm_dtype={p.grad_comm_dtype}: torchtitan reduces gradients in float32"
                                  if p.grad_comm_dtype != "fp32" and p.dp > 1 else None),
    "bucket_mb": lambda p: (f"bucket_mb={p.bucket_mb:g}: torchtitan has no bucket-size setting"
                            if p.bucket_mb != default_of("bucket_mb") else None),
    "recompute": _recompute,
    "schedule": lambda p: (f"virtual_stages={p.virtual_stages}: torchtitan runs 2 stages per rank unless "
                           f"--parallelism.pipeline_parallel_layers_per_stage is the model's blocks / {p.stages}"
                           if p.virtual_stages > 2 else
                           "schedule=zb on 1 stage per rank: torchtitan runs InterleavedZeroBubble on 2 or more "
                           "stages per rank (exported with its default, 2)" if p.schedule == "zb" and p.pp > 1
                           and p.virtual_stages == 1 else None),
    "mesh_order": lambda p: (f"mesh_order={','.join(p.mesh_order)}: torchtitan's mesh is pp, dp, cp, tp (tp innermost)"
                             if tuple(p.mesh_order) != default_of("mesh_order") else None),
    "stage_recompute": lambda p: (f"stage_recompute={','.join(p.stage_recompute)}: torchtitan's activation "
                                  "checkpointing is one mode for every block of every stage (exported as "
                                  f"{covering_recompute(p)[0]})" if covering_recompute(p)[0] != "none" else None),
    "layer_split": lambda p: (f"layer_split={list(p.layer_split)}: set --parallelism.module_fqns_per_model_part by hand"
                              if p.layer_split else None),
}


def unexpressed(plan: Plan) -> list[str]:
    return listed(UNEXPRESSED, plan)


def export(plan: Plan) -> Export:
    return Export("torchtitan", " ".join(overrides(plan)) + "\n", tuple(unexpressed(plan)))
