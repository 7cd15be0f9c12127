"""The mixed search (autopar/mixed/search.py, shares.py, spanning.py): the share DP against brute force,
the mixed plan never slower than the best single group nor above the published-MFU bound, the oracle never
worse than the heuristics, and `autopar search --cluster A:n,B:m` in-process."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import profile, run_cli

from autopar.cluster import load_cluster
from autopar.cluster.mixed import mixed_cluster
from autopar.cost.published_mfu import best_published
from autopar.cost.regime import attention_fused
from autopar.mixed.plan import MixedPlan
from autopar.mixed.cost import estimate_mixed
from autopar.mixed import search as mixed_search
from autopar.mixed.search import lane_of, search_mixed
from autopar.mixed.shares import GRID, best_shares, brute_force_shares, quantum
from autopar.mixed.workload import MixedWorkload
from autopar.search.exhaustive import ExhaustivePlanner
from autopar.search.simplicity import TIE

A, H, R = "dgx-a100-80g", "dgx-h100", "pcie-4090x8"


def test_quantum_leaves_at_most_grid_units():
    assert quantum(256) == 32 and quantum(7) == 1 and quantum(34) == 17 and quantum(96) == 12
    for batch in range(1, 200):
        q = quantum(batch)
        assert batch % q == 0 and batch // q <= GRID


def test_share_dp_equals_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        groups, units = rng.randint(1, 4), rng.randint(1, 8)
        times = [[math.inf] + [rng.choice([math.inf, rng.uniform(0.1, 10)]) for _ in range(units)]
                 for _ in range(groups)]
        value, split = best_shares(times, units)
        assert value == brute_force_shares(times, units)
        if math.isfinite(value):
            assert sum(split) == units and all(k >= 1 for k in split)
            assert max(times[g][k] for g, k in enumerate(split)) == value
        else:
            assert split == ()


def mixed(specs, batch, model_args=None, **kw):
    groups = [load_cluster(preset, nodes=1, gpus_per_node=n) for preset, n in specs]
    return MixedWorkload(profile("gpt", **(model_args or {"size": "tiny"})), mixed_cluster(groups), batch, **kw)


def random_workloads(count: int, seed: int = 42):
    """Small mixed workloads: 2-3 groups of 1-2 GPUs of random types, a random batch."""
    rng = random.Random(seed)
    for _ in range(count):
        specs = [(rng.choice((A, H, R)), rng.choice((1, 2))) for _ in range(rng.choice((2, 2, 3)))]
        yield specs, rng.choice((4, 6, 8, 12))


@pytest.mark.parametrize("specs,batch", list(random_workloads(3)))
def test_mixed_at_least_best_single_and_within_published_mfu(specs, batch):
    mw = mixed(specs, batch)
    result = search_mixed(mw)
    result.plan.validate(mw)
    best = result.best_single
    assert best is not None and result.gain >= 1.0
    assert result.estimate.tokens_per_s >= best[2].tokens_per_s
    bound = 0.0  # every used GPU at its peak x the best published MFU for its type (its peak where none)
    for g in result.plan.groups:
        gpu = mw.cluster.group(g).gpu
        w = mw.on_group(g, mw.cluster.group(g).num_gpus, batch)
        row = best_published(gpu.name, w.runtime, mw.precision, "flash" if attention_fused(w) else "unfused")
        bound += result.plan.gpus(g) * gpu.peak_flops[mw.precision] * (row.mfu if row else 1.0)
    assert result.estimate.model_flops / result.estimate.iteration_time_s <= bound


def test_two_equal_groups_split_the_batch():
    """Two groups of the same GPUs: the lanes share the batch evenly and nearly double either group alone."""
    result = search_mixed(mixed([(H, 1), (H, 1)], 64, {"size": "gpt2-small"}))
    assert sorted(lane.share for lane in result.plan.lanes) == [32, 32] and result.gain > 1.5


@pytest.fixture(scope="module")
def slow_link():
    """4090 boxes (one 100 Gb/s NIC per 8 GPUs) beside A100s: the cross-lane all-reduce matters."""
    mw = mixed([(R, 2), (A, 2)], 64, {"size": "gpt2-small"})
    return mw, search_mixed(mw, "exhaustive")


def test_uneven_shares_follow_the_speeds(slow_link):
    mw, exact = slow_link
    shares = {lane.segments[0].group: lane.share for lane in exact.plan.lanes}
    assert shares[A] > shares[R] > 0 and exact.gain > 1.1 and exact.exact


def test_lanes_all_reduce_across_groups_in_16_bits_where_that_wins(slow_link):
    """Each lane's fastest plan alone reduces in fp32 (the simplest within the tie band); held at bf16 the
    lanes halve the cross-lane all-reduce and win: the search weighs both widths."""
    mw, exact = slow_link
    assert {lane.plan.grad_comm_dtype for lane in exact.plan.lanes} == {"bf16"}
    wide = []
    for lane in exact.plan.lanes:
        g = lane.segments[0].group
        plan = ExhaustivePlanner().propose(mw.on_group(g, mw.cluster.group(g).num_gpus, lane.share))[0]
        wide.append(lane_of(g, plan))
    assert exact.estimate.iteration_time_s < estimate_mixed(mw, MixedPlan(tuple(wide))).iteration_time_s


@pytest.mark.parametrize("method", ["metis", "rl"])
def test_the_exact_search_is_never_worse(slow_link, method):
    mw, exact = slow_link
    other = search_mixed(mw, method)
    other.plan.validate(mw)
    # exact within the homogeneous search's tie band (it returns the simplest plan within 0.5%)
    assert exact.estimate.iteration_time_s <= other.estimate.iteration_time_s * (1 + TIE)
    assert other.estimate.tokens_per_s >= other.best_single[2].tokens_per_s


def test_pruning_two_groups_shares_changes_no_answer(monkeypatch):
    """With two groups the exact search skips a split once one lane of it takes the best step found; pricing
    every split instead finds a plan no faster."""
    mw = mixed([(A, 1), (H, 1)], 32, {"size": "gpt2-small"})
    pruned = search_mixed(mw)
    assert len(pruned.plan.lanes) == 2

    def every_split(lanes, names, units, q, single, upper):
        return {g: lanes.table(g, units, q, range(1, units + 1)) for g in names}

    monkeypatch.setattr(mixed_search, "_pair_tables", every_split)
    full = search_mixed(mw)
    assert pruned.estimate.iteration_time_s == pytest.approx(full.estimate.iteration_time_s, rel=1e-12)


def test_a_time_limit_keeps_the_best_single_group_and_says_so():
    mw = mixed([(A, 1), (H, 1)], 8)
    result = search_mixed(mw, time_limit=0)
    assert not result.exact and result.estimate.tokens_per_s >= result.best_single[2].tokens_per_s


def test_a_model_no_group_holds_alone_spans_the_groups():
    """GPT-2 medium's weights and Adam state (5.7 GB) overflow one 4090 left 4.7 GB (80% headroom); two
    single-4090 groups hold it as a pipeline across them."""
    mw = mixed([(R, 1), (R, 1)], 8, {"size": "gpt2-medium"}, memory_headroom=0.8)
    result = search_mixed(mw, "metis")
    result.plan.validate(mw)
    assert all(v is None for v in result.single.values()) and result.gain is None
    (lane,) = result.plan.lanes
    assert [s.group for s in lane.segments] == list(mw.cluster.group_names) and result.estimate.fits


def test_cli_search_mixed_writes_the_plan(capsys, tmp_path):
    path = tmp_path / "mixed.json"
    code, out, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=tiny", "--cluster", f"{A}:1,{H}:1",
                             "--global-batch", "32", "--method", "metis", "-o", path, "--json")
    assert code == 0, err
    doc = json.loads(out)
    plan = MixedPlan.load(path)
    assert MixedPlan.from_dict(doc["plan"]) == plan and plan.global_batch == 32
    assert doc["gain"] >= 1.0 and doc["best_single"] in (A, H) and doc["estimate"]["tokens_per_s"] > 0


def test_cli_search_mixed_prints_the_plan_beside_the_best_single_group(capsys):
    code, out, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=gpt2-small", "--cluster", f"{A}:1,{H}:1",
                             "--global-batch", "64", "--method", "metis")
    assert code == 0, err
    assert "best single group: dgx-h100 alone" in out and "Why (mixed plan)" in out and "lane 2" in out


@pytest.mark.parametrize("flags,says", [
    (["--cluster", f"{A}:1,{H}:1", "--method", "optuna"], "exhaustive, metis or rl"),
    (["--cluster", f"{A}:1,{H}:1", "--fix", "pp=2"], "--fix applies to one GPU type"),
    (["--cluster", A, "--method", "metis"], "--method metis plans mixed clusters"),
])
def test_cli_refuses_in_one_line(capsys, flags, says):
    code, out, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=tiny", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
