"""Compare the cost model (runtime torch) with the FlashAttention repository's published A100 training speed.

    python experiments/flash_training_a100.py

`data/published/flashattention_training_a100.csv` (its SOURCE.md says where each figure comes from):
GPT-3 125M to 2.7B, sequence 2,048, trained on one node of 8 A100 80GB by the repository's own code
(flash attention, fused MLP, fused dropout-add-LayerNorm; DDP, or ZeRO-1 through
ZeroRedundancyOptimizer; no activation checkpointing). Each row is predicted as autopar's executor
would run it: the GPT written with torch SDPA (tests/models/gpt_sdpa.py, whose causal SDPA is priced
as a flash kernel), runtime torch, the row's data-parallel degree, micro-batch and ZeRO stage, on
the dgx-a100-80g preset, eager and with each block compiled (the nearest thing autopar prices to
the repository's fused kernels). Nothing is fitted to these rows: they check the torch runtime's
flash-attention estimates on A100, which no calibration data covers (docs/hardware.md, "Regime").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.search.published import read_table
from autopar.workload import Workload

SDPA_GPT = Path(__file__).resolve().parents[1] / "tests" / "models" / "gpt_sdpa.py"


def rows() -> list[dict]:
    return read_table("flashattention_training_a100.csv")


def predicted(row: dict) -> dict:
    """Per compile setting (False: eager, True: each block compiled): (tokens/s of the node, MFU,
    plan, estimate) for the row's plan, both on one workload."""
    args = {"size": "gpt3-125m", **{k: int(row[k]) for k in ("hidden", "layers", "heads", "seq_len", "vocab")}}
    gpus, batch, micro = int(row["gpus"]), int(row["global_batch"]), int(row["micro_batch"])
    w = Workload(profile_model(SDPA_GPT, args, dtype="bf16"), load_cluster("dgx-a100-80g", nodes=1, gpus_per_node=gpus),
                 batch, runtime="torch")
    out = {}
    for compiled in (False, True):
        plan = Plan(dp=gpus, micro_batch_size=micro, num_micro_batches=batch // (gpus * micro), zero=int(row["zero"]),
                    recompute="none", compile=compiled)
        est = estimate(w, plan)
        out[compiled] = (batch * w.profile.seq_len / est.iteration_time_s, est.mfu, plan, est)
    return out


def main() -> None:
    table = Table(title="FlashAttention's training code on 8 A100 80GB (tokens/s of the node), runtime torch")
    for name in ("model", "plan (eager)", "published", "eager", "error", "compiled", "error", "MFU compiled", "fits"):
        table.add_column(name, justify="left" if name in ("model", "plan (eager)") else "right")
    errors = {False: [], True: []}
    for row in rows():
        runs = predicted(row)
        eager, _, eager_plan, est = runs[False]
        comp, comp_mfu, _, _ = runs[True]
        for compiled, tokens in ((False, eager), (True, comp)):
            errors[compiled].append(tokens / float(row["tokens_per_s"]) - 1)
        table.add_row(row["model"], eager_plan.describe(), f"{float(row['tokens_per_s']):,.0f}",
                      f"{eager:,.0f}", f"{errors[False][-1]:+.1%}", f"{comp:,.0f}",
                      f"{errors[True][-1]:+.1%}", f"{comp_mfu:.1%}", "yes" if est.fits else "no")
    console = Console(width=200)
    console.print(table)
    for compiled, errs in errors.items():
        e = np.asarray(errs)
        console.print(f"{'compiled' if compiled else 'eager'}: mean error {e.mean():+.1%}, median |error| "
                      f"{np.median(np.abs(e)):.1%}, max {np.abs(e).max():.1%} over {len(e)} rows")


if __name__ == "__main__":
    main()
