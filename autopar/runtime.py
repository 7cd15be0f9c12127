"""The training runtime a workload runs under: what schedules the communication the cost model prices.

The same plan costs different time under different software: Megatron-Core with Transformer
Engine hides tensor-parallel collectives under GEMMs and the data-parallel reduction under
backward, runs fused (flash) attention whatever a model file writes, and shards the optimizer by
reduce-scatter and all-gather; autopar's own executor runs what the model file writes through
torch's DDP, FSDP2, ZeroRedundancyOptimizer, DTensor and torch.distributed.pipelining. Each
overlap is named in an estimate's ``hidden`` breakdown (seconds of communication it hid).

Megatron's switches are off unless the workload names them, as in Megatron-LM's own defaults and
in the runs of its 2021-22 papers (unfused attention with a fused scale-mask-softmax kernel, no
overlaps); NeMo's dense pretraining recipes turn on flash attention and the three overlaps of
`NEMO_SWITCHES` (with `overlap_p2p_comm` for the interleaved schedule).

So a user names the software, not its flags: `megatron-core` is Megatron with NeMo's switches on,
`megatron-lm-2021` the papers' bare Megatron-LM. Plain `megatron` stays what it always was, Megatron
with exactly the switches named (bare: 2021), so stored plans, traces and policies read as before.
A workload resolves a named runtime to `megatron` and its switches (`resolve_runtime`): the cost
model, the records and the fingerprints see one Megatron.
"""

from __future__ import annotations

from autopar.errors import AutoparError

RUNTIMES = {
    "torch": "autopar's executor: DDP / FSDP2 / ZeroRedundancyOptimizer, DTensor, torch.distributed.pipelining; "
             "attention as the model file writes it",
    "megatron": "Megatron-Core with Transformer Engine: fused attention, distributed optimizer, its pipeline "
                "schedules, and only the overlaps named by --switch (none: 2021 Megatron-LM)",
    "megatron-core": "Megatron-Core as NeMo's dense recipes run it: megatron with flash attention and the "
                     "tensor-parallel, gradient-reduce and parameter-gather overlaps on (NEMO_SWITCHES)",
    "megatron-lm-2021": "Megatron-LM as its 2021-22 papers ran it: megatron with no switch on (unfused "
                        "attention, no overlaps)",
}
MEGATRON = "megatron"  # the runtime the named Megatron runtimes resolve to (what records store)
# Megatron-Core's switches that change what the cost model prices (named after their flags)
MEGATRON_SWITCHES = {
    "flash_attn": "--use-flash-attn / TE fused attention: no seq x seq tensor; else Megatron's unfused "
                  "attention (fused scale-mask-softmax, dropout), whose traffic and saved bytes scale with "
                  "the score count",
    "tp_comm_overlap": "--tp-comm-overlap: TE userbuffers split each tensor-parallel collective into chunks "
                       "under the neighbouring GEMM",
    "overlap_grad_reduce": "--overlap-grad-reduce: gradient buckets reduced (distributed optimizer: "
                           "reduce-scattered) during the last micro-batch's backward",
    "overlap_param_gather": "--overlap-param-gather: the distributed optimizer's parameter all-gather during "
                            "the next forward",
    "deepep": "--moe-token-dispatcher-type flex --moe-enable-deepep (or a torch runtime's DeepEP, as NeMo "
              "AutoModel's enable_deepep): DeepEP's dispatch and combine kernels, which "
              "permute and un-permute the routed tokens inside the all-to-all and send a token across nodes once "
              "per destination node (forwarded over NVLink to its experts there)",
    "moe_a2a_overlap": "--overlap-moe-expert-parallel-comm: the dispatch and combine all-to-alls of one micro-batch "
                       "run under another micro-batch's compute (1F1B A2A overlap)",
    "moe_pad_to_capacity": "--moe-pad-expert-input-to-capacity: with a capacity factor, every expert receives and "
                           "computes exactly its capacity (zero padding where fewer tokens chose it); a dropless "
                           "model has no capacity to pad to",
    "megatron_softmax": "Megatron-LM's unfused attention (baddbmm, FusedScaleMaskSoftmax, dropout, bmm) under a "
                        "runtime other than megatron, whatever the model file writes: its traffic and saved bytes "
                        "from the score count, as runtime megatron prices it without flash_attn (the "
                        "Megatron-DeepSpeed runs vTrain measured)",
    "megatron_cross_entropy": "Megatron-LM's vocab-parallel cross-entropy on fp32 logits (output.float(), max, "
                              "exp, sum, divide: unfused passes over the logits) instead of the file's loss, under any "
                              "runtime (the Megatron-DeepSpeed runs vTrain measured)",
    "overlap_p2p_comm": "--overlap-p2p-communication: the interleaved schedule's stage-to-stage sends and "
                        "receives under the next chunk's compute (one per micro-batch stays exposed)",
    "async_tp": "torch's async tensor parallelism (torchtitan's --parallelism.enable_async_tensor_parallel, "
                "torch._inductor's micro-pipelined all-gather-matmul and matmul-reduce-scatter on symmetric memory): "
                "under sequence parallelism each pass's tensor-parallel collective runs in tp chunks under that "
                "pass's GEMMs; torch runtime only",
    "float8_tp": "torchtitan's tensorwise float8 tensor parallelism (torchao's Float8ColwiseParallel, "
                 "Float8RowwiseParallel and PrepareFloat8ModuleInput, its TP plan for tensorwise float8): a region's "
                 "input is cast to fp8 on its sequence shard and all-gathered in fp8; autopar's executor gathers in "
                 "bf16 and casts after the gather; torch runtime only",
    "op_sac": "torchtitan's per-op selective activation checkpointing (--activation-checkpoint.mode selective "
              "--selective-ac-option op): every second matmul of a block and its elementwise ops are recomputed, "
              "attention's kernel is kept; it replaces the attention-core recompute of plan recompute 'selective'; "
              "torch runtime only",
}
NEMO_SWITCHES = ("flash_attn", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")  # dense recipes'
NAMED_RUNTIMES = {"megatron-core": NEMO_SWITCHES, "megatron-lm-2021": ()}  # name -> the switches it turns on
MOE_SWITCHES = ("deepep", "moe_a2a_overlap")  # MoE only; allowed under the torch runtime too
ANY_RUNTIME = (*MOE_SWITCHES, "megatron_softmax", "megatron_cross_entropy")  # switches that name kernels,
# not Megatron-Core's scheduling
TORCH_SWITCHES = ("async_tp", "float8_tp", "op_sac")  # what torch runs and Megatron-Core does not (its own are the flags above)


MEGATRON_VOCAB_MULTIPLE = 128  # --make-vocab-size-divisible-by's default


def vocab_padding(workload) -> int:
    """The multiple, per tensor-parallel rank, to which the runtime pads the vocabulary itself, 0 when it
    runs the file's own: Megatron-LM rounds it up to a multiple of 128 x tp
    (`--make-vocab-size-divisible-by`), so every tp divides it and every rank's slice is aligned, and
    the padded rows and columns are weights and GEMM work like any other (cost/vocabulary.py
    `tp_split`); autopar's executor shards the model file's own vocabulary."""
    return MEGATRON_VOCAB_MULTIPLE if is_megatron(workload.runtime) else 0


def megatron_attention(workload) -> bool:
    """Whether Megatron's own attention runs whatever the model file writes: under runtime megatron,
    or under another runtime with the megatron_softmax switch (Megatron-DeepSpeed's runs)."""
    return is_megatron(workload.runtime) or "megatron_softmax" in workload.switches


def is_megatron(runtime: str) -> bool:
    """Whether a runtime name is Megatron's (plain `megatron` or a named one): what runs Megatron's
    attention, vocabulary padding, schedules and export."""
    return runtime == MEGATRON or runtime in NAMED_RUNTIMES


def resolve_runtime(runtime: str, switches) -> tuple[str, tuple[str, ...]]:
    """(runtime, switches) with a named Megatron runtime written as `megatron` and the switches it
    turns on, after checking both names (one-line errors)."""
    if runtime in NAMED_RUNTIMES:
        return MEGATRON, check_runtime(MEGATRON, (*NAMED_RUNTIMES[runtime], *switches))
    return runtime, check_runtime(runtime, switches)


def check_runtime(runtime: str, switches) -> tuple[str, ...]:
    """The switches as a sorted tuple, after checking both names (one-line errors)."""
    if runtime not in RUNTIMES:
        raise AutoparError(f"unknown runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    switches = tuple(sorted(set(switches)))
    unknown = [o for o in switches if o not in MEGATRON_SWITCHES]
    if unknown:
        raise AutoparError(f"unknown Megatron switch(es) {', '.join(unknown)}; use any of "
                           f"{', '.join(MEGATRON_SWITCHES)}")
    torch_only = [o for o in switches if o in TORCH_SWITCHES]
    if torch_only and runtime != "torch":
        raise AutoparError(f"{', '.join(torch_only)}: torch switches need runtime 'torch' (Megatron-Core's "
                           "counterpart of async_tp is tp_comm_overlap)")
    megatron_only = [o for o in switches if o not in ANY_RUNTIME and o not in TORCH_SWITCHES]  # DeepEP: torch too
    if {"flash_attn", "megatron_softmax"} <= set(switches):
        raise AutoparError("flash_attn and megatron_softmax name two different attention kernels; give one")
    if megatron_only and not is_megatron(runtime):
        raise AutoparError(f"{', '.join(megatron_only)}: Megatron-Core switches need runtime 'megatron' "
                           "(or megatron-core, which turns NeMo's on; the torch runtime overlaps as DDP and FSDP2 do)")
    return switches
