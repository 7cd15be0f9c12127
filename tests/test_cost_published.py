"""The cost model against published figures (docs/references.md), with one set of coefficients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import workload

from autopar.cost import estimate
from autopar.plan import Plan
from autopar.search.published import (
    KORTHIKANTI_TABLE5,
    LLAMA3_TABLE4,
    MEGATRON_TABLE1,
    ZOO_GPT,
    best,
    korthikanti_candidates,
    llama3_candidates,
    megatron_candidates,
)

SECOND_GPT = Path(__file__).resolve().parent / "models" / "gpt_sdpa.py"


@pytest.fixture(scope="module", params=[ZOO_GPT, SECOND_GPT], ids=["bundled-gpt", "gpt-sdpa"])
def table_errors(request):
    """Relative errors of Narayanan et al. SC'21 Table 1 (hardware TFLOP/s, 10 rows) and Korthikanti et
    al. 2022 Table 5 (iteration time, 8 cells), runtime megatron, with the A100 coefficients (fitted to
    the bundled GPT's rows only; the SDPA GPT is never fitted)."""
    errors = {}
    for row in MEGATRON_TABLE1:
        w, candidates = megatron_candidates(row, request.param)
        plan, est = best(w, candidates)
        assert (plan.tp, plan.pp, plan.recompute) == (row.tp, row.pp, "full")
        assert plan.micro_batch_size == row.micro_batch  # the run script's (examples/sc21/run_table_1.sh)
        per_stage = row.layers_per_virtual_stage or w.profile.num_layers // row.pp
        assert plan.virtual_stages * plan.pp * per_stage == w.profile.num_layers
        errors[f"table1 {row.size}"] = est.hw_tflops_per_gpu / row.tflops_per_gpu - 1
    for row in KORTHIKANTI_TABLE5:
        for selective in (False, True):
            plan, est = best(*korthikanti_candidates(row, selective, request.param))
            assert plan.micro_batch_size == row.micro_batch
            published = row.selective_sp_s if selective else row.full_recompute_s
            errors[f"table5 {row.size} {selective}"] = est.iteration_time_s / published - 1
    return errors


def test_megatron_and_korthikanti_rows_both_gpt_files(table_errors):
    """Every one of the 18 figures within 8%, median within 3% (issue 10's bounds), whichever way the GPT
    is written; Table 1 rows as the paper's run script ran them."""
    errors = np.abs(list(table_errors.values()))
    assert errors.max() <= 0.08, table_errors
    assert np.median(errors) <= 0.03, table_errors


PINNED_MEDIANS = {"table1": 0.0342, "table5": 0.0260}  # 2026-12-06, both GPT files (issue 40, acceptance 4)


def test_neither_table_regresses_by_more_than_a_point(table_errors):
    """Each table's median |error| stays within one point of the figure it had before issue 40's fits
    (the same as experiments/published_report.py prints for the bundled GPT)."""
    for table, pinned in PINNED_MEDIANS.items():
        median = np.median([abs(e) for k, e in table_errors.items() if k.startswith(table)])
        assert median <= pinned + 0.01, (table, median, table_errors)


@pytest.mark.parametrize("row", LLAMA3_TABLE4, ids=lambda r: f"{r.gpus}gpus")
def test_llama3_table4_rows_without_context_parallelism(row):
    """Dubey et al. 2024 Table 4, BF16 on H100 (coefficients derived from the A100 fit by the measured
    matmul ceilings, nothing fitted on H100): within 10% on TFLOP/s per GPU (equivalently tokens/s)."""
    plan, est = best(*llama3_candidates(row))
    assert (plan.tp, plan.pp, plan.dp) == (row.tp, row.pp, row.dp)
    assert abs(est.tflops_per_gpu / row.tflops_per_gpu - 1) <= 0.10, (plan.describe(), est.tflops_per_gpu)
    assert est.hidden["tp_comm"] > 0  # the overlaps of Megatron-style runtimes are named and counted


def test_seed_8b_memory_accounting():
    """Seed article: an 8B model on one GPU, ZeRO 0: bf16 weights 16 GB + bf16 gradients 16 GB +
    fp32 Adam moments 64 GB + fp32 master weights 32 GB = 128 GB before activations (to 1%)."""
    w = workload("llama", cluster="dgx-h200", nodes=1, gpus_per_node=1, global_batch=1, size="llama3-8b",
                 seq_len=256)
    assert w.profile.params == pytest.approx(8.03e9, rel=0.01)
    est = estimate(w, Plan(dp=1, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1))
    memory = {k: v / 1e9 for k, v in est.memory.items()}
    scale = w.profile.params / 8e9  # the seed rounds the model to 8B
    for part, gb in (("weights", 16), ("gradients", 16), ("optimizer_states", 64), ("master_weights", 32)):
        assert memory[part] == pytest.approx(gb * scale, rel=1e-6)
        assert memory[part] == pytest.approx(gb, rel=0.01)
    states = sum(memory[p] for p in ("weights", "gradients", "optimizer_states", "master_weights"))
    assert states == pytest.approx(128, rel=0.01)
