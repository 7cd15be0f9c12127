"""Published mixture-of-experts training throughput the cost model is checked against
(`data/published/moe_automodel_dgx_h100_bf16.csv`, docs/references.md §11).

NVIDIA NeMo AutoModel's DGX-H100 BF16 table: PyTorch FSDP2 with expert parallelism, Transformer
Engine's kernels (linear, RMSNorm, fused attention), DeepEP's dispatcher, torch.distributed.pipelining
(interleaved 1F1B), a force-balanced gate. autopar prices a row as that software runs it: runtime
``torch`` (FSDP2 and torch.distributed.pipelining, as autopar's own executor runs them) with the
``deepep`` switch (DeepEP's dispatch and combine); the model is the zoo's shape of the same name (`autopar/zoo/moe.py`; DeepSeek-V3's MLA is
approximated there). Nothing is fitted to these rows: every coefficient is the H100's (derived from
the A100 fit, docs/hardware.md).

The benchmark's gate (``fake_balanced_gate``, SOURCE.md) sends the token at index i to experts
i·k ... i·k + k − 1: the rows are priced with the zoo's ``gate="balanced"``, which routes the same way,
so DeepEP's copies per token are the ranks and nodes those consecutive experts sit on (1 rank for
Qwen3-30B-A3B and GPT-OSS-20B at EP 8, 2 ranks on one node for GPT-OSS-120B and DeepSeek-V3 at EP 64;
`autopar.cost.moe.destinations`). Without pipeline parallelism the gradient accumulation is the plan's
micro-batches; with it, AutoModel runs one pipeline schedule of local_batch / micro_batch micro-batches
grad_accum times a step, a bubble each time, which is no plan of autopar's (`expressible`): the
DeepSeek-V3 row on 1,024 GPUs (and Kimi K2, not a zoo shape) are left out of the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.plan import Plan, balanced_split
from autopar.profile import profile_model
from autopar.search.published import read_table
from autopar.workload import Workload
from autopar.zoo import path as zoo_path

TABLE = "moe_automodel_dgx_h100_bf16.csv"
# the zoo shape of each model (GPT-OSS-20B is the 120B's architecture with 24 layers of 32 experts:
# huggingface.co/openai/gpt-oss-20b, config.json)
ZOO_SHAPES = {"Qwen3-30B-A3B": {"size": "qwen3-30b-a3b"}, "GPT-OSS-20B": {"size": "gpt-oss-120b", "layers": 24,
              "experts": 32}, "GPT-OSS-120B": {"size": "gpt-oss-120b"}, "DeepSeek-V3-671B": {"size": "deepseek-v3"}}
AUTOMODEL_SWITCHES = ("deepep",)  # DeepEP's kernels; the rest is PyTorch's FSDP2 and pipelining
BENCHMARK_GATE = {"gate": "balanced", "route_group_limit": 0}  # fake_balanced_gate: true in every row's config


@dataclass(frozen=True)
class MoeRow:
    """One row of the AutoModel table that autopar can express: a zoo shape, degrees, batches."""

    model: str
    gpus: int
    global_batch: int
    micro_batch: int
    local_batch: int
    grad_accum: int
    tp: int
    pp: int
    ep: int
    vp: int
    recompute: bool
    reshard: bool
    tokens_per_s_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def label(self) -> str:
        return f"{self.model} on {self.gpus} GPUs"


def _row(r: dict[str, str]) -> MoeRow:
    return MoeRow(r["model"], int(r["gpus"]), int(r["global_batch"]), int(r["micro_batch"]), int(r["local_batch"]),
                  int(r["grad_accum"]), int(r["tp"]), int(r["pp"]), int(r["ep"]), int(r["vp"]),
                  r["activation_checkpointing"] == "true", r["reshard_after_forward"] == "true",
                  float(r["tokens_per_s_per_gpu"]))


ALL_ROWS = tuple(_row(r) for r in read_table(TABLE) if r["ep"] and r["activation_checkpointing"])


def expressible(row: MoeRow) -> str | None:
    """None when autopar's plan space holds the row's setup, else why not."""
    if row.model not in ZOO_SHAPES:
        return f"{row.model} is not a zoo shape"
    if row.pp > 1 and row.grad_accum > 1:
        return (f"gradient accumulation x{row.grad_accum} around the pipeline schedule (a bubble per schedule) "
                "is not a plan autopar makes: its micro-batches all run in one schedule")
    return None


MOE_ROWS = tuple(row for row in ALL_ROWS if expressible(row) is None)


def moe_workload(row: MoeRow) -> Workload:
    """The row's model on dgx-h100 nodes, as AutoModel runs it."""
    profile = profile_model(zoo_path("moe"), {**ZOO_SHAPES[row.model], **BENCHMARK_GATE}, dtype="bf16")
    return Workload(profile, load_cluster("dgx-h100", nodes=max(1, row.gpus // 8)), row.global_batch, runtime="torch",
                    switches=AUTOMODEL_SWITCHES)


def moe_plan(row: MoeRow, workload: Workload) -> Plan:
    """The row's plan: its degrees and micro-batch, full recompute where it checkpoints, ZeRO-3 where FSDP2
    reshards after forward (else ZeRO-2), interleaved 1F1B with its virtual stages under pp."""
    layers = workload.profile.num_layers
    per_rank = workload.global_batch // row.dp
    return Plan(dp=row.dp, tp=row.tp, pp=row.pp, ep=row.ep, micro_batch_size=row.micro_batch,
                num_micro_batches=per_rank // row.micro_batch, zero=3 if row.reshard else 2,
                recompute="full" if row.recompute else "none",
                recompute_blocks=-(-layers // row.pp) if row.recompute else 0,
                schedule="interleaved" if row.vp > 1 else "1f1b", virtual_stages=row.vp,
                layer_split=balanced_split(layers, row.pp * row.vp))


def predicted_tokens_per_s(row, coeffs=None):
    """(plan, estimate, tokens/s per GPU) the cost model gives the row (an AutoModel or a Megatron-Bridge
    one), under the H100's coefficients or `coeffs`."""
    w = moe_workload(row) if isinstance(row, MoeRow) else bridge_workload(row)
    plan = moe_plan(row, w) if isinstance(row, MoeRow) else bridge_plan(row, w)
    est = estimate(w, plan, coeffs)
    return plan, est, w.global_batch * w.profile.seq_len / est.iteration_time_s / row.gpus


# -- Megatron-Bridge 25.11, DGX-H100 (data/published/megatron_bridge_25.11_h100.SOURCE.md) -----------------
BRIDGE_TABLE = "megatron_bridge_25.11_h100.csv"
BRIDGE_SHAPES = {"GPT OSS 120B": {"size": "gpt-oss-120b"}, "Qwen3_30B_a3B": {"size": "qwen3-30b-a3b"}}
# Megatron-Bridge's recipes: TE fused attention, the distributed optimizer's two overlaps; the H100 MoE
# configs run Megatron-Core's alltoall dispatcher (no DeepEP), the Qwen3 one with the 1F1B A2A overlap
BRIDGE_SWITCHES = ("flash_attn", "overlap_grad_reduce", "overlap_param_gather")
BRIDGE_EXTRA = {"Qwen3_30B_a3B": ("moe_a2a_overlap",)}  # QWEN3_30B_A3B_..._H100_FP8_CS: moe_a2a_overlap=True
BRIDGE_PRECISION = {"BF16": "bf16", "FP8-CS": "fp8"}  # FP8-CS: TE's current (per-tensor) scaling


@dataclass(frozen=True)
class BridgeRow:
    """One MoE row of Megatron-Bridge 25.11's DGX-H100 table: Megatron-Core with TE, no recompute (the
    perf scripts clear it; GPT-OSS's recompute modules are inactive without selective granularity),
    the table's degrees, global and micro-batch."""

    model: str
    gpus: int
    precision: str
    global_batch: int
    micro_batch: int
    tp: int
    pp: int
    vp: int
    ep: int
    tokens_per_s_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def label(self) -> str:
        return f"{self.model} on {self.gpus} GPUs ({self.precision})"

    @property
    def switches(self) -> tuple[str, ...]:
        """Megatron-Core's switches the row's config turns on (overlap_p2p_comm: pp > 1 with vp > 1)."""
        p2p = ("overlap_p2p_comm",) if self.pp > 1 and self.vp > 1 else ()
        return (*BRIDGE_SWITCHES, *BRIDGE_EXTRA.get(self.model, ()), *p2p)


def _bridge_row(r: dict[str, str]) -> BridgeRow:
    vp = int(r["vp"]) if r["vp"].isdigit() else 1
    return BridgeRow(r["model"], int(r["gpus"]), r["precision"], int(r["global_batch"]), int(r["micro_batch"]),
                     int(r["tp"]), int(r["pp"]), vp, int(r["ep"]), float(r["tokens_per_s_per_gpu"]))


BRIDGE_ROWS = tuple(_bridge_row(r) for r in read_table(BRIDGE_TABLE) if int(r["ep"]) > 1)


def bridge_workload(row: BridgeRow) -> Workload:
    """The row's model on dgx-h100 nodes under runtime megatron with the config's switches. The router's
    forced balance (random logits, a uniform choice per token) is the zoo's learned gate at imbalance 1."""
    profile = profile_model(zoo_path("moe"), BRIDGE_SHAPES[row.model], dtype="bf16")
    return Workload(profile, load_cluster("dgx-h100", nodes=max(1, row.gpus // 8)), row.global_batch,
                    runtime="megatron", switches=row.switches, fp8=BRIDGE_PRECISION[row.precision] == "fp8")


def bridge_plan(row: BridgeRow, workload: Workload) -> Plan:
    """The row's plan: its degrees and micro-batch, the distributed optimizer (ZeRO-1), bf16 gradient
    reduction, no recompute, interleaved 1F1B with its virtual stages under pp, FP8 per-tensor scaling."""
    layers = workload.profile.num_layers
    precision = BRIDGE_PRECISION[row.precision]
    return Plan(dp=row.dp, tp=row.tp, pp=row.pp, ep=row.ep, micro_batch_size=row.micro_batch,
                num_micro_batches=row.global_batch // (row.dp * row.micro_batch), zero=1, recompute="none",
                precision=precision, **({"fp8_recipe": "tensorwise"} if precision == "fp8" else {}),
                schedule="interleaved" if row.vp > 1 else "1f1b", virtual_stages=row.vp,
                grad_comm_dtype="bf16", layer_split=balanced_split(layers, row.pp * row.vp))


def framework(row) -> str:
    """Which published table a row is from."""
    return "AutoModel" if isinstance(row, MoeRow) else "Megatron-Bridge"


def settings(row) -> str:
    """The runtime settings a row is priced with, beside its plan: runtime, dispatcher, switches, batch."""
    if isinstance(row, MoeRow):
        return (f"torch (FSDP2{', reshard' if row.reshard else ''}) + DeepEP, balanced gate, "
                f"{'full recompute' if row.recompute else 'no recompute'}, global batch {row.global_batch}")
    return (f"megatron, {row.precision}, alltoall dispatcher, TE's per-expert GEMM loop (host-paced after the "
            f"dispatcher's sync), {', '.join(row.switches)}, no recompute, global batch {row.global_batch}")


ROWS = (*MOE_ROWS, *BRIDGE_ROWS)  # every MoE row autopar prices, both frameworks
