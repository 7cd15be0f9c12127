"""Megatron-Core's dense DGX-H100 rows: NeMo 24.07 (FP8) and Megatron-Bridge 25.11's Llama 3 rows
(FP8 with current scaling), the rows issue 40's acceptance 3 holds the cost model to.

The NeMo rows are `published.NEMO_FP8`, priced by `published.nemo_candidates`. The Megatron-Bridge
dense rows (`data/published/megatron_bridge_25.11_h100.csv`, ep 1) are priced here with their
configs' settings, read from Megatron-Bridge at the table's commit (00b7660b,
`scripts/performance/configs/llama/llama3{,1}_workload_base_configs.py`, `llama3_llm_pretrain.py`,
`utils/overrides.py`, `src/megatron/bridge/recipes/llama/llama3.py`; SOURCE.md): TE fused attention,
the distributed optimizer with its gradient-reduce and parameter-gather overlaps, gradients reduced in
bf16 (`grad_reduce_in_fp32 = False`), TE's tensor-parallel overlap where tp > 1, sequence parallelism
with tp, no CUDA graphs on H100; Llama 3 8B recomputes 5 layers in full (`recompute_num_layers=5`:
granularity full, method block); the table's `fsdp` 1 is Megatron-FSDP (parameters, gradients and
optimizer states sharded: ZeRO-3). Every row's family is its model's (Llama 3 for all three), so a fit
that leaves a family out leaves NeMo's Llama 3 rows out with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import load_cluster
from autopar.cost.arrays import PlanArrays
from autopar.plan import Plan, balanced_split
from autopar.profile import profile_model
from autopar.runtime import NEMO_SWITCHES
from autopar.search.published import NEMO_FP8, NEMO_MODELS, ZOO_LLAMA, NemoRow, nemo_candidates, read_table
from autopar.workload import Workload

BRIDGE_TABLE = "megatron_bridge_25.11_h100.csv"
# the zoo's shapes (Llama 3.1 405B is Llama 3 405B's architecture at sequence 8192)
BRIDGE_DENSE_MODELS = {"LLAMA3_8B": {"size": "llama3-8b"}, "LLAMA3_70B": {"size": "llama3-70b"},
                       "LLAMA3.1_405B": {"size": "llama3-405b", "seq_len": 8192}}
BRIDGE_RECOMPUTE_LAYERS = {"LLAMA3_8B": 5}  # LLAMA3_8B_PRETRAIN_CONFIG_H100_FP8_CS: recompute_num_layers=5


@dataclass(frozen=True)
class BridgeDenseRow:
    """One dense row of Megatron-Bridge 25.11's DGX-H100 table (FP8 with current scaling)."""

    model: str
    gpus: int
    global_batch: int
    micro_batch: int
    seq_len: int
    fsdp: bool
    tp: int
    pp: int
    cp: int
    vp: int
    tokens_per_s_per_gpu: float

    @property
    def family(self) -> str:
        return "Llama 3"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def label(self) -> str:
        return f"Bridge {self.model} on {self.gpus} GPUs"


def _row(r: dict[str, str]) -> BridgeDenseRow:
    return BridgeDenseRow(r["model"], int(r["gpus"]), int(r["global_batch"]), int(r["micro_batch"]), int(r["seq_len"]),
                          r["fsdp"] == "1", int(r["tp"]), int(r["pp"]), int(r["cp"]),
                          int(r["vp"]) if r["vp"].isdigit() else 1, float(r["tokens_per_s_per_gpu"]))


BRIDGE_DENSE = tuple(_row(r) for r in read_table(BRIDGE_TABLE) if int(r["ep"]) <= 1)


def bridge_dense_candidates(row: BridgeDenseRow) -> tuple[Workload, PlanArrays]:
    """(workload, the one plan) for a dense Bridge row on dgx-h100 nodes, runtime megatron, fp8 with
    per-tensor scaling, the config's switches; the run fit, so the budget is the GPU's whole memory."""
    profile = profile_model(ZOO_LLAMA, BRIDGE_DENSE_MODELS[row.model], dtype="bf16")
    if profile.seq_len != row.seq_len:
        raise AssertionError(f"{row.model}: profiled at sequence {profile.seq_len}, the row has {row.seq_len}")
    switches = tuple(s for s in NEMO_SWITCHES if s != "tp_comm_overlap" or row.tp > 1)
    p2p = ("overlap_p2p_comm",) if row.pp > 1 and row.vp > 1 else ()
    w = Workload(profile, load_cluster("dgx-h100", nodes=max(1, row.gpus // 8)), row.global_batch,
                 runtime="megatron", switches=(*switches, *p2p), fp8=True, memory_headroom=0.0)
    layers = profile.num_layers
    blocks = BRIDGE_RECOMPUTE_LAYERS.get(row.model, 0)
    cp = {"cp": row.cp} if row.cp > 1 else {}
    plan = Plan(dp=row.dp, tp=row.tp, pp=row.pp, **cp, micro_batch_size=row.micro_batch,
                num_micro_batches=row.global_batch // (row.dp * row.micro_batch), zero=3 if row.fsdp else 1,
                recompute="full" if blocks else "none", recompute_blocks=blocks, precision="fp8",
                fp8_recipe="tensorwise", schedule="interleaved" if row.vp > 1 else "1f1b", virtual_stages=row.vp,
                sequence_parallel=row.tp > 1, grad_comm_dtype="bf16" if row.dp > 1 else "fp32",
                layer_split=balanced_split(layers, row.pp * row.vp))
    return w, PlanArrays.from_plans([plan], profile)


ROWS: tuple[NemoRow | BridgeDenseRow, ...] = (*NEMO_FP8, *BRIDGE_DENSE)


def candidates(row) -> tuple[Workload, PlanArrays]:
    """(workload, plans) of any dense Megatron-Core row."""
    return bridge_dense_candidates(row) if isinstance(row, BridgeDenseRow) else nemo_candidates(row)


def parameters(row) -> float:
    """The row's model parameters (the profile's count), for the error's slope against size."""
    w, _ = candidates(row)
    return float(w.profile.params)


def model_of(row) -> str:
    return row.model


__all__ = ["BRIDGE_DENSE", "ROWS", "BridgeDenseRow", "bridge_dense_candidates", "candidates", "parameters",
           "NEMO_MODELS"]
