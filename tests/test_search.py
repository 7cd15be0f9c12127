"""Planners: the exhaustive oracle is optimal over the space; rules give valid plans; errors
explain why no plan exists."""

from __future__ import annotations

import pytest
from conftest import workload

from autopar.cost import PlanArrays, estimate, evaluate
from autopar.errors import NoValidPlanError
from autopar.plan import Plan
from autopar.search import get_planner, planner_names
from autopar.search.published import MEGATRON_TABLE1, best, megatron_candidates
from autopar.search.simplicity import TIE
from autopar.search.space import enumerate_plans


def test_exhaustive_finds_the_fastest_fitting_plan():
    w = workload(size="gpt2-medium", vocab=50304, nodes=2, global_batch=128)
    space = enumerate_plans(w)
    res = evaluate(w, space)
    best = get_planner("exhaustive").propose(w, 3)
    t_best = estimate(w, best[0]).iteration_time_s
    assert t_best <= res["iteration_time"][res["fits"]].min() * (1 + TIE)
    times = [estimate(w, p).iteration_time_s for p in best]
    assert all(b <= a * (1 + TIE) for a, b in zip(times[1:], times))  # best first, up to ties
    assert len({p.describe() for p in best}) == 3


def test_space_has_no_duplicates_and_only_valid_plans():
    w = workload(size="tiny", nodes=1, global_batch=32)
    space = enumerate_plans(w)
    plans = [space.plan(i) for i in range(len(space))]
    assert len(set(plans)) == len(plans)
    for p in plans:
        p.validate(w)
    assert PlanArrays.from_plans(plans, w.profile).plan(len(plans) - 1) == plans[-1]


@pytest.mark.parametrize("row", [r for r in MEGATRON_TABLE1 if r.size in ("1.7b", "39.1b", "145.6b")],
                         ids=lambda r: r.size)
@pytest.mark.heavy
def test_rl_planner_beats_megatrons_published_configurations(row):
    """Megatron-LM SC'21 Table 1 (data/published/megatron_sc21_table1.csv) on its own cluster and
    runtime. Rule: the published configuration is the paper's tp and pp with full recompute, no
    ZeRO, 16-bit gradient reduction and 25 MB buckets, the micro-batch, interleaving and DDP of its
    run script (`megatron_candidates`, as `experiments/cost_vs_published.py` predicts the row);
    the plan of `autopar search` (the rl planner's top-8, which never enumerates the space) must be
    at least as fast under the same cost model. Today it is 1.3-1.7x faster (less recompute)."""
    w, published = megatron_candidates(row)
    _, published_estimate = best(w, published)
    found = estimate(w, get_planner("rl").propose(w, 8)[0])
    assert found.fits and found.iteration_time_s <= published_estimate.iteration_time_s * (1 + TIE), (
        f"{row.size}: found {found.iteration_time_s:.3f} s, "
        f"published configuration {published_estimate.iteration_time_s:.3f} s")


def test_rules_planner_gives_a_valid_plan_that_fits():
    for size, nodes, batch in (("gpt2-small", 1, 64), ("175b", 16, 512)):
        w = workload(size=size, vocab=50304, nodes=nodes, global_batch=batch)
        plan = get_planner("rules").propose(w, 1)[0]
        plan.validate(w)
        assert estimate(w, plan).fits
    big = workload(size="175b", nodes=16, global_batch=512)
    plan = get_planner("rules").propose(big, 1)[0]
    assert plan.pp > 1  # deep (96 blocks) and does not fit one GPU: the rules pipeline it


def test_unknown_method_is_a_clear_error():
    with pytest.raises(Exception, match="unknown planning method 'nope'"):
        get_planner("nope")
    assert {"exhaustive", "rules"} <= set(planner_names())


def test_batch_that_no_plan_divides():
    w = workload(size="tiny", nodes=8, global_batch=6)  # 64 GPUs, 4 layers, 4 heads: dp >= 4
    with pytest.raises(NoValidPlanError, match="global batch 6 is not divisible by any data-parallel degree"):
        get_planner("exhaustive").propose(w)


def test_model_that_fits_no_plan_says_what_it_needs():
    w = workload(size="1t", cluster="dgx-a100-80g", nodes=1, global_batch=8)
    with pytest.raises(NoValidPlanError) as e:
        get_planner("exhaustive").propose(w)
    msg = str(e.value)
    assert "fits no plan on 8 x" in msg and "GB per GPU" in msg and "GPUs" in msg


def test_exhaustive_respects_memory():
    w = workload(size="39.1b", nodes=4, global_batch=64)
    for p in get_planner("exhaustive").propose(w, 5):
        assert estimate(w, p).fits
    assert not estimate(w, Plan(dp=32, tp=1, pp=1, micro_batch_size=2, num_micro_batches=1)).fits


def test_rules_planner_plans_fp8_workloads_compiled_where_compile_is_offered():
    """fp8 pays only compiled: the rules planner turns compile on where the space offers it (tp = pp
    = 1) and off elsewhere (it read the compile choices without the degrees they depend on)."""
    import dataclasses

    base = workload(cluster="dgx-h100", size="gpt2-small")
    plan = get_planner("rules").propose(dataclasses.replace(base, fp8=True), 1)[0]
    assert plan.precision == "fp8" and plan.compile == (plan.tp == plan.pp == 1)
