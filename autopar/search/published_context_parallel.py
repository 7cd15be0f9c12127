"""Published runs with context parallelism, against the cost model (docs/context-parallel.md).

Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4: the long-context row, Llama 3 405B at
131,072 tokens on 16,384 H100s, TP8 CP16 PP16 DP8, 380 model TFLOP/s per GPU; read from
`data/published/other_h100.csv` and planned as the sequence-8192 rows are (`llama3_candidates`:
runtime megatron with NeMo's switches, Meta's degrees and batch; open: schedule, recompute, ZeRO
1 or 2, gradient dtype). Nothing is fitted to it. The NeMo 24.07 rows with CP2 are FP8 and are
checked with the FP8 rows.
"""

from __future__ import annotations

from autopar.search.published import _llama3_row, best, llama3_candidates, read_table

LLAMA3_CP_TABLE4 = tuple(_llama3_row(r) for r in read_table("other_h100.csv")
                         if r["source"] == "Llama 3 paper Table 4" and "CP1 " not in r["config"])


def context_parallel_rows() -> list[tuple[str, float, float, float]]:
    """(row, predicted TFLOP/s per GPU, published, relative error) for each Table 4 row with cp > 1."""
    out = []
    for row in LLAMA3_CP_TABLE4:
        plan, est = best(*llama3_candidates(row))
        label = f"Llama 3 405B {row.gpus} GPUs seq {row.seq_len} {plan.describe()}"
        out.append((label, est.tflops_per_gpu, row.tflops_per_gpu, est.tflops_per_gpu / row.tflops_per_gpu - 1))
    return out
