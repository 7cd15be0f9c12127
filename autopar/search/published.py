"""Published measurements the cost model is checked against (docs/references.md).

The figures are read from the repository's copies in `data/published/` (each with a SOURCE.md
naming the paper, table and URL), so a clone reproduces every comparison.

Tests assert the errors; `experiments/cost_vs_published.py` prints them and refits the default
coefficients. Each case restricts the plan space to what the paper states and lets the cost
model choose what the paper leaves open (micro-batch size, interleaving), as the paper's
authors tuned those too.
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
GPIPE, ONE_F_ONE_B, INTERLEAVED = (SCHEDULES.index(s) for s in ("gpipe", "1f1b", "interleaved"))
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
    """Narayanan et al., SC'21, Table 1: weak scaling on DGX A100 80GB, full recompute,
    interleaved schedule; throughput counts the recompute forward (hardware FLOPs)."""

    size: str
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float


MEGATRON_TABLE1 = tuple(MegatronRow(r["model"], int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"]),
                                    float(r["tflops_per_gpu"])) for r in read_table("megatron_sc21_table1.csv"))


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


def _workload(size: str, gpus: int, global_batch: int, model=ZOO_GPT):
    """The paper's model (from `model`, any GPT file taking the zoo's sizes) on Selene's DGX A100s, run
    by Megatron-LM as of 2021-22: runtime megatron with none of the later overlap switches."""

    profile = profile_model(model, {"size": size}, dtype="bf16")
    return Workload(profile, load_cluster("selene", nodes=gpus // 8 or 1, gpus_per_node=min(gpus, 8)),
                    global_batch, runtime="megatron")


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
    """(workload, plans) with the paper's tp, pp and full recompute, gradients all-reduced in 16 bits
    (Megatron-LM 2021 under --fp16); micro-batch and interleaving open."""

    w = _workload(row.size, row.gpus, row.global_batch, model)
    s = enumerate_plans(w)
    full_all = s.recompute_blocks == np.array([s.splits.entries[i]["layers"].max() for i in s.split])
    mask = ((s.tp == row.tp) & (s.pp == row.pp) & (s.recompute == FULL) & full_all & (s.zero == 0)
            & ~s.sequence_parallel & (s.grad_comm_dtype == GRAD16) & (s.mesh_order == DEFAULT_ORDER)
            & (s.bucket_mb == 25.0) & (s.schedule != GPIPE))
    return w, s.take(np.flatnonzero(mask))


def korthikanti_candidates(row: KorthikantiRow, selective: bool, model=ZOO_GPT):
    """(workload, plans) for one Table 5 cell: the paper's degrees and micro-batch; full
    recompute, or selective recompute with sequence parallelism."""

    w = _workload(row.size, row.gpus, row.global_batch, model)
    s = enumerate_plans(w)
    full_all = s.recompute_blocks == np.array([s.splits.entries[i]["layers"].max() for i in s.split])
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
