"""The cost model against published figures (REFERENCES.md), with one set of coefficients."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.cost import estimate
from autopar.cost.published import (KORTHIKANTI_TABLE5, MEGATRON_TABLE1, best, korthikanti_candidates,
                                    megatron_candidates)
from autopar.plan import Plan
from conftest import workload


def test_megatron_sc21_table1_hardware_tflops():
    """Narayanan et al. SC'21 Table 1: every row within 15%, median error <= 8%."""
    errors = []
    for row in MEGATRON_TABLE1:
        plan, est = best(*megatron_candidates(row))
        assert (plan.tp, plan.pp, plan.recompute) == (row.tp, row.pp, "full")
        errors.append(est.hw_tflops_per_gpu / row.tflops_per_gpu - 1)
    errors = np.abs(errors)
    assert errors.max() <= 0.15, errors
    assert np.median(errors) <= 0.08, errors


@pytest.mark.parametrize("row", KORTHIKANTI_TABLE5, ids=lambda r: r.size)
@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective+sp"])
def test_korthikanti_table5_iteration_time(row, selective):
    """Korthikanti et al. 2022 Table 5: iteration time within 15% for both recompute modes."""
    plan, est = best(*korthikanti_candidates(row, selective))
    published = row.selective_sp_s if selective else row.full_recompute_s
    assert plan.micro_batch_size == row.micro_batch
    assert abs(est.iteration_time_s / published - 1) <= 0.15, (plan.describe(), est.iteration_time_s, published)


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
