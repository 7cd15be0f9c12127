"""Published measurements the cost model is checked against (docs/references.md).

The figures are read from the repository's copies in `data/published/` (each with a SOURCE.md
naming the paper, table and URL), so a clone reproduces every comparison.

Tests assert the errors; `experiments/cost_vs_published.py` prints them and refits the default
coefficients. Each case restricts the plan space to what the paper states and lets the cost
model choose what neither the paper nor its run scripts state, as the paper's authors tuned
those too.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.cluster import load_cluster
from autopar.cost import estimates_from, evaluate
from autopar.cost.arrays import PlanArrays
from autopar.plan import COMM_DTYPES, RECOMPUTE_MODES, SCHEDULES, Plan, balanced_split
from autopar.profile import profile_model
from autopar.runtime import NEMO_SWITCHES
from autopar.search.space import enumerate_plans
from autopar.workload import Workload

FULL, SELECTIVE = RECOMPUTE_MODES.index("full"), RECOMPUTE_MODES.index("selective")
ONE_F_ONE_B, INTERLEAVED = (SCHEDULES.index(s) for s in ("1f1b", "interleaved"))
GRAD16 = COMM_DTYPES.index("bf16")  # Megatron-LM 2021 under --fp16 all-reduced 16-bit gradients
DEFAULT_ORDER = 0  # mesh order code of the default order (tp innermost; see cost.arrays.mesh_order_code)
ZOO_GPT = Path(__file__).resolve().parent.parent / "zoo" / "gpt.py"
DATA = Path(__file__).resolve().parents[2] / "data" / "published"


def read_table(name: str) -> list[dict[str, str]]:
    """The rows of `data/published/<name>` as dicts of strings."""
    with open(DATA / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class MegatronRow:
    """Narayanan et al., SC'21, Table 1: weak scaling on DGX A100 80GB, full recompute; throughput
    counts the recompute forward (hardware FLOPs). Micro-batch, layers per virtual stage (0: not
    interleaved) and DDP wrapper are the paper's artifact's (Megatron-LM examples/sc21/run_table_1.sh):
    `torch` DDP reduces gradients in buckets during the last micro-batch's backward, `local` after it."""

    size: str
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    micro_batch: int
    layers_per_virtual_stage: int
    ddp: str

    @property
    def switches(self) -> tuple[str, ...]:
        """Megatron-Core's name for what torch's DDP did under Megatron-LM 2021 (no_sync on all but
        the last micro-batch, buckets all-reduced under its backward)."""
        return ("overlap_grad_reduce",) if self.ddp == "torch" else ()


MEGATRON_TABLE1 = tuple(MegatronRow(r["model"], int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"]),
                                    float(r["tflops_per_gpu"]), int(r["micro_batch"]),
                                    int(r["layers_per_virtual_stage"]), r["ddp"])
                        for r in read_table("megatron_sc21_table1.csv"))


@dataclass(frozen=True)
class KorthikantiRow:
    """Korthikanti et al. 2022, Table 5: iteration time on DGX A100 80GB, no data parallelism."""

    size: str
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    interleaved: bool
    full_recompute_s: float
    selective_sp_s: float


KORTHIKANTI_TABLE5 = tuple(
    KorthikantiRow(r["model"], int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"]),
                   int(r["micro_batch"]), r["interleaved"] == "true", float(r["full_recompute_s"]),
                   float(r["selective_sp_s"]))
    for r in read_table("korthikanti_2022_table5.csv"))


def _workload(size: str, gpus: int, global_batch: int, model=ZOO_GPT, switches=()):
    """The paper's model (from `model`, any GPT file taking the zoo's sizes) on Selene's DGX A100s, run
    by Megatron-LM as of 2021-22: runtime megatron with none of the later overlap switches but
    `switches` (what the paper's run did by other means), and Megatron-LM's loss on fp32 logits
    (`megatron_cross_entropy`: `--fp16-lm-cross-entropy` was off by default)."""

    profile = profile_model(model, {"size": size}, dtype="bf16")
    return Workload(profile, load_cluster("selene", nodes=gpus // 8 or 1, gpus_per_node=min(gpus, 8)),
                    global_batch, runtime="megatron", switches=tuple(sorted({*switches, "megatron_cross_entropy"})))


def best(workload, candidates, coeffs=None):
    """The fastest plan that fits among the candidates, with its estimate."""

    sub = candidates
    res = evaluate(workload, sub, coeffs)
    ok = np.flatnonzero(res["fits"])
    if len(ok) == 0:
        raise AssertionError(f"no plan fits for {workload.describe()}")
    i = ok[np.argmin(res["iteration_time"][ok])]
    return sub.plan(i), estimates_from(workload, sub, res, i)[0]


def megatron_candidates(row: MegatronRow, model=ZOO_GPT):
    """(workload, plans) with the run script's tp, pp, micro-batch, virtual stages and DDP, full
    recompute, gradients all-reduced in 16 bits (Megatron-LM 2021 under --fp16)."""

    w = _workload(row.size, row.gpus, row.global_batch, model, row.switches)
    s = enumerate_plans(w, {"tp": row.tp, "pp": row.pp, "micro_batch_size": row.micro_batch, "zero": 0,
                            "bucket_mb": 25.0})
    full_all = s.recomputes_every_block()
    chunks = row.layers_per_virtual_stage and w.profile.num_layers // (row.pp * row.layers_per_virtual_stage)
    sched = ((s.schedule == INTERLEAVED) & (s.virtual_stages == chunks) if chunks
             else (s.schedule == ONE_F_ONE_B))  # Megatron's 1F1B (not a zero-bubble schedule)
    mask = ((s.tp == row.tp) & (s.pp == row.pp) & (s.micro_batch_size == row.micro_batch) & sched
            & (s.recompute == FULL) & full_all & (s.zero == 0) & ~s.sequence_parallel
            & (s.grad_comm_dtype == GRAD16) & (s.mesh_order == DEFAULT_ORDER) & (s.bucket_mb == 25.0))
    return w, s.take(np.flatnonzero(mask))


def korthikanti_candidates(row: KorthikantiRow, selective: bool, model=ZOO_GPT):
    """(workload, plans) for one Table 5 cell: the paper's degrees and micro-batch; full
    recompute, or selective recompute with sequence parallelism."""

    w = _workload(row.size, row.gpus, row.global_batch, model)
    s = enumerate_plans(w, {"tp": row.tp, "pp": row.pp, "micro_batch_size": row.micro_batch})
    full_all = s.recomputes_every_block()
    sp = s.sequence_parallel
    mode = (s.recompute == SELECTIVE) & sp if selective else (s.recompute == FULL) & full_all & ~sp
    sched = (s.schedule == INTERLEAVED) if row.interleaved else (s.schedule == ONE_F_ONE_B)
    mask = (s.tp == row.tp) & (s.pp == row.pp) & (s.micro_batch_size == row.micro_batch) & mode & sched
    return w, s.take(np.flatnonzero(mask))


@dataclass(frozen=True)
class Llama3Row:
    """Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4: Llama 3 405B pre-training on H100
    SXM 80GB (DGX-H100-class nodes, NVLink within 8, RoCE / InfiniBand across), BF16, sequence 8192,
    no context parallelism (the CP16 row at 131072 tokens needs context parallelism: next issue).
    The paper gives model TFLOP/s per GPU; its FLOPs convention is not stated, so rows are compared on
    tokens/s derived with autopar's own (docs/hardware.md), equivalently on TFLOP/s per GPU."""

    gpus: int
    tp: int
    pp: int
    dp: int
    batch_per_dp: int
    tflops_per_gpu: float
    cp: int = 1
    seq_len: int = 8192

    @property
    def global_batch(self) -> int:
        return self.dp * self.batch_per_dp


def _llama3_row(r: dict[str, str]) -> Llama3Row:
    """A Table 4 row of `other_h100.csv`: its `config` reads "TP8 CP1 PP16 DP64, batch per DP 32"."""
    degree = {axis: int(n) for axis, n in re.findall(r"\b(TP|CP|PP|DP)(\d+)", r["config"])}
    batch = int(re.search(r"batch per DP (\d+)", r["config"]).group(1))
    return Llama3Row(int(r["gpus"]), degree["TP"], degree["PP"], degree["DP"], batch, float(r["value"]),
                     degree["CP"], int(r["seq_len"]))


LLAMA3_TABLE4 = tuple(_llama3_row(r) for r in read_table("other_h100.csv")
                      if r["source"] == "Llama 3 paper Table 4" and "CP1 " in r["config"])
ZOO_LLAMA = Path(__file__).resolve().parent.parent / "zoo" / "llama.py"


def llama3_candidates(row: Llama3Row, model=ZOO_LLAMA):
    """(workload, plans) for one Table 4 row on dgx-h100 nodes, runtime megatron with every switch on
    (Meta's stack overlaps its collectives and runs fused attention): the paper's degrees and batch,
    micro-batch 1, sequence parallel; open: 1F1B or interleaved with 2-7 virtual stages (126 layers
    split unevenly, as the paper's pipeline does), recompute none / selective / full, ZeRO 1 or 2
    (the paper shards optimizer states and gradients), gradients reduced in bf16 or fp32."""

    profile = profile_model(model, {"size": "llama3-405b", "seq_len": row.seq_len}, dtype="bf16")
    w = Workload(profile, load_cluster("dgx-h100", nodes=row.gpus // 8), row.global_batch, runtime="megatron",
                 switches=NEMO_SWITCHES)
    layers = profile.num_layers
    plans = []
    for v in range(1, 8):
        for recompute, blocks in (("none", 0), ("selective", 0), ("full", layers)):
            for zero in (1, 2):
                for comm in ("bf16", "fp32"):
                    plans.append(Plan(dp=row.dp, tp=row.tp, pp=row.pp, cp=row.cp, micro_batch_size=1,
                                      num_micro_batches=row.batch_per_dp, zero=zero, recompute=recompute,
                                      recompute_blocks=min(blocks, -(-layers // row.pp)),
                                      schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
                                      sequence_parallel=True, grad_comm_dtype=comm,
                                      layer_split=balanced_split(layers, row.pp * v)))
    return w, PlanArrays.from_plans(plans, profile)


# NeMo 24.07's model configs (NeMo-Framework-Launcher tag 24.07, commit 8325688d,
# `launcher_scripts/conf/training/<family>/<size>.yaml`) as zoo overrides: GPT-3, Nemotron-8B and
# Nemotron-22B are GPT-style (GeLU / squared-ReLU MLP of 4 x hidden, full multi-head attention:
# `num_query_groups: null`; 22B is 21.3B parameters so; `hidden_dropout: 0.0` for Nemotron, 0.1 for GPT-3,
# as the GPT file's default); Llama 2 and 3 are the zoo's own sizes (no dropout).
# Nemotron-340B uses grouped-query attention (8 groups), which the GPT zoo file cannot express: it is
# the Llama file with Nemotron-4's squared-ReLU MLP (`mlp="squared_relu"`) at its ffn of 4 x hidden.
NEMO_MODELS = {
    "GPT3-5B": (ZOO_GPT, {"size": "gpt3-6.7b", "hidden": 4096, "layers": 24, "heads": 32}),
    "GPT3-20B": (ZOO_GPT, {"size": "gpt3-13b", "hidden": 6144, "layers": 44, "heads": 48}),
    "GPT3-175B": (ZOO_GPT, {"size": "gpt3-175b"}),
    "LLAMA2-7B": (ZOO_LLAMA, {"size": "llama2-7b"}),
    "LLAMA2-13B": (ZOO_LLAMA, {"size": "llama2-13b"}),
    "LLAMA2-70B": (ZOO_LLAMA, {"size": "llama2-70b"}),
    "LLAMA3-8B": (ZOO_LLAMA, {"size": "llama3-8b"}),
    "LLAMA3-70B": (ZOO_LLAMA, {"size": "llama3-70b"}),
    "Nemotron-8B": (ZOO_GPT, {"size": "gpt3-6.7b", "hidden": 4096, "layers": 32, "heads": 32, "vocab": 256000,
                              "seq_len": 4096, "dropout": 0.0}),
    "Nemotron-22B": (ZOO_GPT, {"size": "gpt3-6.7b", "hidden": 6144, "layers": 40, "heads": 48, "vocab": 256000,
                               "seq_len": 4096, "dropout": 0.0}),
    "Nemotron-340B": (ZOO_LLAMA, {"size": "llama2-70b", "hidden": 18432, "layers": 96, "heads": 96, "kv_heads": 8,
                                  "ffn": 73728, "vocab": 256000, "mlp": "squared_relu"}),
}
NEMO_FAMILIES = {"GPT3": "GPT-3", "LLAMA2": "Llama 2", "LLAMA3": "Llama 3", "Nemotron": "Nemotron"}


@dataclass(frozen=True)
class NemoRow:
    """NVIDIA NeMo 24.07 performance summary, pre-training on DGX-H100 in FP8 (Megatron-Core with
    Transformer Engine): the published degrees (tp, pp, cp, vp), micro-batch and tokens/s per GPU, and
    the 24.07 recipe's recompute mode and gradient-reduction dtype (data/published/*.SOURCE.md)."""

    model: str
    gpus: int
    global_batch: int
    micro_batch: int
    seq_len: int
    tp: int
    pp: int
    cp: int
    vp: int
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    recompute: str  # "none" or "selective": the recipe's activations_checkpoint_granularity
    grad_sync_dtype: str  # "bf16" or "fp32": the distributed optimizer's gradient reduction

    @property
    def family(self) -> str:
        return NEMO_FAMILIES[self.model.split("-")[0]]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)


NEMO_FP8 = tuple(NemoRow(r["model"], *(int(r[c]) for c in ("gpus", "global_batch", "micro_batch", "seq_len", "tp",
                                                           "pp", "cp", "vp")),
                         float(r["tokens_per_s_per_gpu"]), float(r["model_tflops_per_gpu"]), r["recompute"],
                         r["grad_sync_dtype"])
                 for r in read_table("nemo_24.07_dgx_h100_fp8.csv"))


def nemo_candidates(row: NemoRow):
    """(workload, plans) for one NeMo row on dgx-h100 nodes, runtime megatron with NeMo's overlap switches,
    fp8 with Transformer Engine's per-tensor scaling: the one plan the 24.07 recipe runs (published
    degrees, micro-batch and virtual stages, the distributed optimizer (ZeRO-1), sequence parallel
    under tensor parallelism, the recipe's recompute mode and gradient-reduction dtype); nothing open.
    The run is known to have fit, so the budget is the GPU's whole memory (no search headroom): the
    estimate must fit there, a check of the memory model."""
    model, args = NEMO_MODELS[row.model]
    profile = profile_model(model, args, dtype="bf16")
    if profile.seq_len != row.seq_len:
        raise AssertionError(f"{row.model}: profiled at sequence {profile.seq_len}, the row has {row.seq_len}")
    w = Workload(profile, load_cluster("dgx-h100", nodes=row.gpus // 8), row.global_batch, runtime="megatron",
                 switches=(*NEMO_SWITCHES, "overlap_p2p_comm"), fp8=True,  # the recipes' interleaved overlap
                 memory_headroom=0.0)
    layers = profile.num_layers
    cp = {"cp": row.cp} if row.cp > 1 else {}  # the context-parallel axis, where declared
    plan = Plan(dp=row.dp, tp=row.tp, pp=row.pp, **cp, micro_batch_size=row.micro_batch,
                num_micro_batches=row.global_batch // (row.dp * row.micro_batch), zero=1,
                recompute=row.recompute, recompute_blocks=0, precision="fp8", fp8_recipe="tensorwise",
                schedule="interleaved" if row.vp > 1 else "1f1b", virtual_stages=row.vp,
                sequence_parallel=row.tp > 1, grad_comm_dtype=row.grad_sync_dtype if row.dp > 1 else "fp32",
                layer_split=balanced_split(layers, row.pp * row.vp))
    return w, PlanArrays.from_plans([plan], profile)
