"""Compare the cost model with NeMo AutoModel's published MoE training throughput on DGX-H100 (BF16).

    python experiments/cost_vs_published_moe.py

For each row of `data/published/moe_automodel_dgx_h100_bf16.csv` that a zoo model expresses
(`autopar/search/published_moe.py`: Qwen3-30B-A3B, GPT-OSS-20B and -120B, DeepSeek-V3 on 256 GPUs)
it prints the published and predicted tokens/s per GPU, the error, and the predicted breakdown of the
step (expert-parallel all-to-all included). Nothing is fitted: the H100 coefficients are those every
other H100 estimate uses (docs/hardware.md). The issue's bounds: median |error| <= 15%, max <= 25%.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.search.published_moe import ALL_ROWS, MOE_ROWS, expressible, predicted_tokens_per_s

SHOWN = ("compute", "recompute", "ep_comm", "pp_bubble", "dp_comm")


def main() -> None:
    table = Table(title="MoE rows: NeMo AutoModel DGX-H100 BF16 (tokens/s per GPU)")
    for name in ("row", "plan", "published", "predicted", "error", *SHOWN):
        table.add_column(name, justify="left" if name in ("row", "plan") else "right")
    errors = []
    for row in MOE_ROWS:
        plan, est, tokens = predicted_tokens_per_s(row)
        err = tokens / row.tokens_per_s_per_gpu - 1
        errors.append(err)
        share = {p: est.breakdown[p] / est.iteration_time_s for p in SHOWN}
        table.add_row(row.label, plan.describe(), f"{row.tokens_per_s_per_gpu:,.0f}", f"{tokens:,.0f}",
                      f"{err:+.1%}", *(f"{share[p]:.0%}" for p in SHOWN))
    console = Console(width=200)
    console.print(table)
    errs = np.abs(errors)
    console.print(f"median |error| {np.median(errs):.1%}, max {errs.max():.1%} over {len(errs)} rows "
                  "(issue 14 asks <= 15% and <= 25%)")
    for row in ALL_ROWS:
        if row not in MOE_ROWS:
            console.print(f"left out: {row.label} ({row.tokens_per_s_per_gpu:,.0f} tokens/s per GPU): {expressible(row)}")


if __name__ == "__main__":
    main()
