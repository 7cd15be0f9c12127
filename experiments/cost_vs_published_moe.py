"""Compare the cost model with published mixture-of-experts training throughput on DGX-H100.

    python experiments/cost_vs_published_moe.py

Every MoE row autopar expresses, from both frameworks (`autopar/search/published_moe.py`):

- NVIDIA NeMo AutoModel's BF16 table (`data/published/moe_automodel_dgx_h100_bf16.csv`): PyTorch FSDP2,
  DeepEP, grouped_gemm's CUTLASS experts; Qwen3-30B-A3B, GPT-OSS-20B and -120B, DeepSeek-V3 on 256 GPUs;
- Megatron-Bridge 25.11's DGX-H100 MoE rows (`data/published/megatron_bridge_25.11_h100.csv`):
  Megatron-Core with TE, the alltoall dispatcher, TE GroupedLinear's per-expert GEMM loop; GPT-OSS-120B
  BF16 (pp 4, ep 8) and Qwen3-30B-A3B FP8 current scaling (pp 2, vp 24, ep 8, the 1F1B A2A overlap).

For each it prints the settings priced, the published and predicted tokens/s per GPU, the error, how
the row was fitted, and the predicted breakdown of the step. The H100's coefficients (derived from the
A100 fit, docs/hardware.md) and the MoE fixed costs fitted to these six rows (`autopar.cost.moe.FIT`);
`experiments/fit_moe.py` holds each row out of that fit. Issue 40's acceptance 2: median |error| <= 10%,
max <= 20% over the rows of both frameworks, leave-one-row-out.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.search.published_moe import (
    ALL_ROWS,
    MOE_ROWS,
    ROWS,
    expressible,
    framework,
    predicted_tokens_per_s,
    settings,
)

SHOWN = ("compute", "recompute", "ep_comm", "pp_bubble", "pp_p2p", "dp_comm")
FIT = "H100 coefficients + moe.FIT (all six rows)"


def main() -> None:
    table = Table(title="MoE rows on DGX-H100 (tokens/s per GPU)")
    for name in ("framework", "row", "plan", "published", "predicted", "error", "fit", *SHOWN):
        table.add_column(name, justify="left" if name in ("framework", "row", "plan", "fit") else "right")
    errors = []
    for row in ROWS:
        plan, est, tokens = predicted_tokens_per_s(row)
        err = tokens / row.tokens_per_s_per_gpu - 1
        errors.append(err)
        share = {p: est.breakdown.get(p, 0.0) / est.iteration_time_s for p in SHOWN}
        table.add_row(framework(row), row.label, plan.describe(), f"{row.tokens_per_s_per_gpu:,.0f}",
                      f"{tokens:,.0f}", f"{err:+.1%}", FIT, *(f"{share[p]:.0%}" for p in SHOWN))
    console = Console(width=240)
    console.print(table)
    for row in ROWS:
        console.print(f"{row.label}: {settings(row)}")
    errs = np.abs(errors)
    console.print(f"median |error| {np.median(errs):.1%}, max {errs.max():.1%} over {len(errs)} rows under the shipped "
                  "MoE fit (leave-one-row-out: experiments/fit_moe.py; issue 40 asks <= 10% and <= 20%)")
    am = np.abs(errors[:len(MOE_ROWS)])
    console.print(f"AutoModel rows alone: median {np.median(am):.1%}, max {am.max():.1%} (issue 14: <= 15%, <= 25%)")
    for row in ALL_ROWS:
        if row not in MOE_ROWS:
            console.print(f"left out: {row.label} ({row.tokens_per_s_per_gpu:,.0f} tokens/s per GPU): {expressible(row)}")


if __name__ == "__main__":
    main()
