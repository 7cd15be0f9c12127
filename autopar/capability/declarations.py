"""The capability rules of today, one per knob or axis (`autopar.capability.core.Rule`).

Rules that name autopar's torch executor (`target.torch`) hold for `autopar run` and the torch
runtime only: under a Megatron runtime Megatron-Core builds, shards and pipelines the model
itself (any module names, any tp_plan, sequence parallelism with MoE, ep beside cp, the
distributed optimizer over experts) and never runs torch.compile. The rest hold for every runtime:
what the model has (attention, experts, a tensor-parallel plan) and what the hardware has (fp8
tensor cores, bf16 reductions).
"""

from __future__ import annotations

from dataclasses import replace

from autopar.capability.core import Device, Layout, Rule, Target, allowed, check, declare_rule, refusal

FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8")  # torchao's recipes (autopar.knobs names the knob's values)
# torch.distributed.pipelining's zero-bubble schedules (autopar.knobs SCHEDULES names them with the others)
ZERO_BUBBLE = ("zb", "zbv", "dualpipev")
BLOCK_SCALED = ("mxfp8",)  # recipes the GPU must have block-scaled fp8 tensor cores for
FP8_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (8, 9), "mxfp8": (10, 0)}  # Ada/Hopper; Blackwell for MX
# Published recipes run cp with 4,096 (NeMo 24.07, CP2 at 8K) to 8,192 (Llama 3, CP16 at 128K) tokens
# per rank; below 2,048 the sequence fits a rank without it, and the K/V exchange outgrows attention.
CP_MIN_TOKENS = 2048
MOE_SP = ("sequence parallelism with an MoE model: each tp rank would route its part of the sequence and the "
          "router's and experts' gradients would miss the other tp ranks'; use sequence_parallel false")


# -- the axes ---------------------------------------------------------------------------------------------
def _tp(target: Target, tp: int, decided) -> str | None:
    """A tensor-parallel plan, and a sequence-parallel setting that runs at this degree."""
    layout = target.layout
    if tp == 1 or layout is None:
        return None
    if not layout.tp_plan:
        return f"tp={tp} but {layout.tp_note or 'the model has no tensor-parallel plan'}"
    if not allowed("sequence_parallel", target, (False, True), {"tp": tp}):
        return (f"tp={tp} runs neither without sequence parallelism "
                f"({refusal('sequence_parallel', target, False, {'tp': tp})}) nor with it "
                f"({refusal('sequence_parallel', target, True, {'tp': tp})}); use another tp")
    return None


def _pp(target: Target, pp: int, decided) -> str | None:
    layout = target.layout
    if pp == 1 or layout is None:
        return None
    if not layout.blocks:
        return "pipeline parallelism needs the model's repeated blocks (an nn.ModuleList); use pp=1"
    if target.torch and "pp" in layout.limits:
        return f"pp={pp} but {layout.limits['pp']}"
    return None


def _cp(target: Target, cp: int, decided) -> str | None:
    """Context parallelism splits attention over the sequence: the model needs attention (a score
    count), and causal load balancing cuts the sequence into 2 x cp chunks (rank i holds chunks i
    and 2cp-1-i), under Megatron-Core as under torch."""
    layout = target.layout
    if cp == 1 or layout is None:
        return None
    if layout.attention is False:
        return f"cp={cp} but the model {layout.name} has no attention over a sequence to split; use cp=1"
    if target.torch and "cp" in layout.limits:
        return f"cp={cp} but {layout.limits['cp']}"
    if layout.seq_len is not None and layout.seq_len % (2 * cp):
        return (f"cp={cp} needs the sequence length {layout.seq_len} divisible by 2 x cp = {2 * cp} (causal load "
                f"balancing cuts it into 2 x cp chunks); use a cp with 2 x cp dividing {layout.seq_len}")
    return None


def _ep(target: Target, ep: int, decided) -> str | None:
    """autopar's executor shards experts stacked as the zoo's GroupedExperts, over ranks of dp alone."""
    if ep == 1 or not target.torch:
        return None
    if target.layout is not None and "ep" in target.layout.limits:
        return f"ep={ep} but {target.layout.limits['ep']}"
    cp = decided.get("cp", 1)
    if cp > 1:
        return f"ep={ep} with cp={cp}: the executor does not combine them yet; use ep=1 or cp=1"
    return None


def _dp_replicate(target: Target, replicas: int, decided) -> str | None:
    """HSDP: autopar's executor shards the dense weights on FSDP2's 2-D (replicate, shard) mesh but
    its experts over the expert-data-parallel ranks, which it does not split into replicas."""
    ep = decided.get("ep", 1)
    if replicas > 1 and ep > 1 and target.torch:
        return f"dp_replicate={replicas} with ep={ep}: the executor does not combine HSDP with expert parallelism; " \
               "use dp_replicate 1 or ep 1"
    return None


def _mesh_order(target: Target, order, decided) -> str | None:
    """HSDP's 2-D mesh is dp x cp flattened with dp outermost (its outer ranks the replicas): the
    executor unflattens it so, which a mesh order putting cp outside dp does not allow."""
    replicas, cp = decided.get("dp_replicate", 1), decided.get("cp", 1)
    order = tuple(order or ())
    if (replicas > 1 and cp > 1 and target.torch and {"cp", "dp"} <= set(order)
            and order.index("cp") < order.index("dp")):
        return (f"mesh_order {','.join(order)} with dp_replicate={replicas} and cp={cp}: the executor's HSDP mesh "
                "needs dp outside cp; use the default mesh order")
    return None


def _schedule(target: Target, schedule: str, decided) -> str | None:
    """The zero-bubble schedules split each backward into an input-gradient pass and a weight-gradient
    pass (torch's stage_backward_input / stage_backward_weight, two autograd.grad calls on one graph).
    Megatron-Core's releases have none (sail-sg's zero-bubble fork of Megatron-LM does). Under autopar's
    executor, measured on 4 gloo ranks (fp32, tiny GPT): full recompute, tp, ZeRO-2 (FSDP2 keeping
    parameters gathered) and tied embeddings keep parity; DDP's reducer never sees gradients that
    autograd.grad returns (zero 0 and 1 would not average them), ZeRO-3's resharded parameters give
    wrong weight gradients. (Selective recompute, which no runtime runs with them, is the plan's own
    rule: `autopar.knobs`.)"""
    if schedule not in ZERO_BUBBLE:
        return None
    if not target.torch:
        return (f"schedule {schedule}: Megatron-Core has no zero-bubble or DualPipe schedule; use 1f1b or "
                "interleaved (or the torch runtime)")
    zero, ranks = decided.get("zero", 0), decided.get("dp", 1) * decided.get("cp", 1)
    if ranks > 1 and zero in (0, 1):
        return (f"schedule {schedule} with zero {zero} over {ranks} data-parallel ranks: its weight gradients come "
                "from autograd.grad, which DDP's reducer never averages; use zero 2")
    if ranks > 1 and zero == 3:
        return (f"schedule {schedule} with zero 3: FSDP2 resharding after forward gives wrong weight gradients "
                "under torch's split backward; use zero 2")
    return None


def context_parallel_offered(workload, cp: int) -> str | None:
    """The plan space offers cp only while each rank keeps CP_MIN_TOKENS tokens or more (a plan may
    still name a smaller share: it is valid, runs and is priced; the space just does not search it)."""
    tokens = workload.profile.seq_len // cp
    if cp > 1 and tokens < CP_MIN_TOKENS:
        return f"cp={cp} leaves {tokens} tokens per rank; the plan space offers cp from {CP_MIN_TOKENS} up"
    return None


# -- the knobs --------------------------------------------------------------------------------------------
def _sequence_parallel(target: Target, on: bool, decided) -> str | None:
    tp = decided.get("tp", 1)
    layout = target.layout
    if tp == 1:
        return None  # sequence parallelism without tensor parallelism: the plan's own check (knobs._check_sp)
    flag = f"sequence_parallel={str(on).lower()} with tp={tp}, but "
    if on and layout is not None and layout.seq_len is not None and layout.seq_len % tp:
        return flag + f"the sequence length {layout.seq_len} is not divisible by tp={tp}"
    if not target.torch:
        return None
    if on and layout is not None and layout.moe:  # ep > 1 needs experts, so this covers ep with SP too
        return MOE_SP
    limits = layout.limits if layout is not None else {}
    if on and "sp" in limits:
        return flag + limits["sp"]
    if not on and "sp_off" in limits:
        return flag + limits["sp_off"]
    return None


def _zero(target: Target, zero: int, decided) -> str | None:
    ep = decided.get("ep", 1)
    if zero == 1 and ep > 1 and target.torch:
        return (f"zero 1 with ep={ep}: ZeRO-1's optimizer would broadcast one rank's experts over another's; "
                f"use zero 0, 2 or 3")
    return None


def comm_dtype_problem(dtype: str, backend: str) -> str | None:
    """What a backend cannot reduce in: gloo has no bf16 reductions."""
    if dtype == "bf16" and "nccl" not in backend:  # "cpu:gloo,cuda:nccl" reduces GPU tensors over NCCL
        return (f"grad_comm_dtype 'bf16' reduces gradients in bfloat16, which needs NCCL, not {backend}; "
                f"use grad_comm_dtype 'fp16' or 'fp32' on this backend")
    return None


def _grad_comm_dtype(target: Target, dtype: str, decided) -> str | None:
    return comm_dtype_problem(dtype, target.backend_name) if target.gloo is not None else None


def compile_problem(plan) -> str | None:
    """What autopar's executor cannot compile (the torch runtime's rule on a whole plan)."""
    return _compile(Target(), plan.compile, {"tp": plan.tp, "pp": plan.pp})


def _compile(target: Target, on: bool, decided) -> str | None:
    """torch.compile of each block: autopar's executor compiles blocks without tensor or pipeline
    parallelism (torch 2.13's compiled autograd of a checkpointed DTensor block saves a DeviceMesh and
    fails; a pipeline stage is not verified); Megatron-Core runs its own fused kernels, never torch.compile."""
    if not on:
        return None
    if not target.torch:
        return "compile: Megatron-Core runs Transformer Engine's fused kernels, not torch.compile; set compile false"
    tp, pp = decided.get("tp", 1), decided.get("pp", 1)
    if tp > 1 or pp > 1:
        return (f"compile with tp={tp}, pp={pp}: the executor compiles blocks without tensor or "
                "pipeline parallelism only; set compile false or tp = pp = 1")
    return None


def _cuda_graphs(target: Target, on: bool, decided) -> str | None:
    """CUDA graphs capture the blocks' kernels once and replay them with one launch: CUDA only; under the
    torch runtime they are torch.compile's mode="reduce-overhead" on the compiled blocks (compile on),
    under Megatron-Core its own (`--enable-cuda-graph`)."""
    if not on:
        return None
    if target.device is not None and target.device.type != "cuda":
        return f"cuda_graphs needs CUDA GPUs; this run is on {target.device.type}: set cuda_graphs false"
    if target.device is None and target.gloo:
        return (f"cuda_graphs needs CUDA GPUs; this run is on {target.backend_name} (CPU processes): set "
                "cuda_graphs false")
    if target.torch and not decided.get("compile", False):
        return ("cuda_graphs under the torch runtime is torch.compile's mode='reduce-overhead' of the compiled "
                "blocks: set compile true, or cuda_graphs false")
    return None


def fp8_problem(precision: str, gpu, recipe: str | None = None) -> str | None:
    """Why a GPU cannot train in `precision` with `recipe` (None: it can): fp8 needs fp8 tensor
    cores (Hopper, Ada, Blackwell: `peak_flops["fp8"]`), MXFP8 block-scaled ones (Blackwell)."""
    if precision != "fp8":
        return None
    if not gpu.peak_flops.get("fp8"):
        return (f"precision fp8 needs a GPU with fp8 tensor cores (H100, H200, B200, GB200); {gpu.name} has none: "
                f"use --precision bf16")
    if recipe in BLOCK_SCALED and not gpu.peak_flops.get(recipe):
        return (f"fp8 recipe {recipe} needs block-scaled fp8 tensor cores (B200, GB200); {gpu.name} has none: "
                f"use recipe tensorwise or rowwise")
    return None


def _device_problem(recipe: str, device: Device) -> str | None:
    if device.type != "cuda":
        return (f"precision fp8 needs CUDA GPUs with fp8 tensor cores; this run is on {device.type}: "
                "use precision bf16")
    need, have = FP8_CAPABILITY[recipe], device.capability
    if have is not None and have < need:
        return (f"fp8 recipe {recipe} needs compute capability {need[0]}.{need[1]}+, {device.name} has "
                f"{have[0]}.{have[1]}: use precision bf16"
                + (" or recipe tensorwise / rowwise" if recipe == "mxfp8" and have >= (8, 9) else ""))
    return None


def _fp8_recipe(target: Target, recipe: str, decided) -> str | None:
    """fp8 training (its recipe stands for it: an fp8 plan always names one) on this hardware and model."""
    if recipe == "none":
        return None
    if target.cluster is not None:
        problem = fp8_problem("fp8", target.cluster.gpu, recipe)
        if problem:
            return problem
    if target.device is not None:
        problem = _device_problem(recipe, target.device)
        if problem:
            return problem
    elif target.gloo:
        return (f"precision fp8 needs CUDA GPUs with fp8 tensor cores (H100, H200, B200, GB200); this run is on "
                f"{target.backend_name} (CPU processes): use precision bf16")
    if target.torch and target.layout is not None and not target.layout.blocks:
        return "precision fp8 converts the model's repeated blocks (an nn.ModuleList); use precision bf16"
    return None


for _rule in (Rule("tp", _tp), Rule("pp", _pp), Rule("cp", _cp), Rule("ep", _ep, ("cp",)),
              Rule("sequence_parallel", _sequence_parallel, ("tp",)), Rule("zero", _zero, ("ep",)),
              Rule("grad_comm_dtype", _grad_comm_dtype), Rule("compile", _compile, ("tp", "pp")),
              Rule("fp8_recipe", _fp8_recipe), Rule("cuda_graphs", _cuda_graphs, ("compile",)),
              Rule("schedule", _schedule, ("dp", "cp", "zero")),
              Rule("dp_replicate", _dp_replicate, ("ep",)), Rule("mesh_order", _mesh_order, ("cp", "dp_replicate"))):
    declare_rule(_rule)


def sequence_parallel_options(target: Target, tp: int) -> tuple[bool, ...]:
    """The sequence-parallel settings that run at tensor-parallel degree ``tp`` (off, then on)."""
    return tuple(allowed("sequence_parallel", target, (False, True) if tp > 1 else (False,), {"tp": tp}))


# the Why table's rows for what the plan space never offers a model: (knob, the values left out)
EXCLUDED_ROWS = {"pp": ("pp", "pp > 1"), "sp": ("sequence_parallel", "sequence parallel on"),
                 "sp_off": ("sequence_parallel", "sequence parallel off"), "cp": ("cp", "cp > 1"),
                 "ep": ("ep", "ep > 1")}


def excluded(target: Target) -> list[tuple[str, str, str]]:
    """What the plan space leaves out for this model on this target, whatever the rest of the plan:
    (limit, knob, "... not considered: why") rows for the Why table and the JSON's `excluded`."""
    layout = target.layout
    if layout is None or not target.torch:
        return []  # Megatron-Core lays the model out itself
    out = [(k, *EXCLUDED_ROWS[k][:1], f"{EXCLUDED_ROWS[k][1]} not considered: {why}")
           for k, why in layout.limits.items() if k in EXCLUDED_ROWS]
    # sequence parallelism refused at every tp by the model's other facts (an MoE model): the rule at a tp
    # whatever the sequence length
    on = refusal("sequence_parallel", replace(target, layout=replace(layout, seq_len=None)), True, {"tp": 2})
    if on and "sp" not in layout.limits:
        out.append(("sp", "sequence_parallel", f"sequence parallel on not considered: {on}"))
    return out


def check_plan(plan, profile) -> None:
    """The torch executor's rules for a plan on a profiled model (tests and the executor's callers)."""
    check(plan, Target(layout=Layout.of(profile)))
