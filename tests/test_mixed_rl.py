"""The rl mixed search (autopar/mixed/search.py: the policy per group, other shares re-batched) and the
re-planning of a mixed plan for a new mix (autopar/mixed/replan.py, `autopar search --replan-from`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import run_cli
from test_mixed_search import A, H, R, mixed

from autopar.cost import estimate, evaluate
from autopar.errors import NoValidPlanError, PlanError
from autopar.mixed import search as mixed_search
from autopar.mixed.plan import MixedPlan
from autopar.mixed.replan import replan_mixed
from autopar.mixed.search import rebatched, search_mixed
from autopar.plan import Plan
from autopar.policies.planner import RLPlanner
from autopar.search.space import enumerate_plans


@pytest.fixture(scope="module")
def two_groups():
    """Two groups of two GPUs (A100s, H100s), a tiny GPT at 32 samples, rl's result on them and the
    (group, share) of each policy call it made."""
    mw = mixed([(A, 2), (H, 2)], 32)
    calls = []
    original = mixed_search._Lanes._propose

    def counted(self, group, workload):
        calls.append((group, workload.global_batch))
        return original(self, group, workload)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mixed_search._Lanes, "_propose", counted)
        result = search_mixed(mw, "rl")
    return mw, result, calls


def test_rl_calls_the_policy_at_most_twice_per_group(two_groups):
    """Each group alone and at its proportional share: the other shares of the grid (8 units here) are the
    policy's plans re-batched, the chosen ones the exact search's."""
    mw, result, calls = two_groups
    assert len(result.plan.lanes) == 2 and len(calls) <= 2 * len(mw.group_names), calls
    assert result.estimate.tokens_per_s >= result.best_single[2].tokens_per_s


def test_rebatched_takes_the_fastest_micro_batching_of_the_same_plan(two_groups):
    mw, result, _ = two_groups
    lane = max(result.plan.lanes, key=lambda lane: lane.share)
    group = lane.segments[0].group
    workload = mw.on_group(group, mw.cluster.group(group).num_gpus, lane.share // 2)
    plan, seconds = rebatched(workload, [lane.plan])
    plan.validate(workload)
    assert (plan.dp, plan.tp, plan.pp, plan.zero) == (lane.plan.dp, lane.plan.tp, lane.plan.pp, lane.plan.zero)
    per = workload.global_batch // plan.dp
    for mbs in (m for m in range(1, per + 1) if per % m == 0):
        other = lane.plan.with_(micro_batch_size=mbs, num_micro_batches=per // mbs)
        est = estimate(workload, other)
        assert not est.fits or seconds <= est.iteration_time_s * (1 + 1e-12)
    assert rebatched(mw.on_group(group, 2, 1), [lane.plan]) is None or lane.plan.dp == 1


def _slowest_plan_that_fits(self, workload, k=1):
    """A policy at its worst: the slowest plan of the space that fits (what rl's policy calls return below)."""
    space = enumerate_plans(workload)
    res = evaluate(workload, space)
    fit = np.flatnonzero(res["fits"])
    if len(fit) == 0:
        raise NoValidPlanError("no plan fits")
    return [space.plan(int(fit[np.argmax(res["iteration_time"][fit])]))]


@pytest.mark.parametrize("specs,batch,size", [
    ([(R, 1), (A, 1)], 8, "gpt2-small"),  # one group alone is the answer (the A100s)
    ([(A, 2), (H, 2)], 32, "tiny"),  # two data-parallel lanes
])
def test_the_exact_search_finishes_what_a_weak_policy_proposes(monkeypatch, specs, batch, size):
    """rl's policy proposes, the exact homogeneous search finishes the group alone and the chosen lanes: with the
    policy at its worst (its every plan the slowest that fits) rl still comes within 0.97 of the exact mixed
    search. Where rl kept the policy's plans (a group alone, the chosen lanes), it fell to 0.77 of it."""
    mw = mixed(specs, batch, {"size": size})
    exact = search_mixed(mw)
    monkeypatch.setattr(RLPlanner, "propose", _slowest_plan_that_fits)
    rl = search_mixed(mw, "rl")
    rl.plan.validate(mw)
    assert rl.estimate.tokens_per_s >= 0.97 * exact.estimate.tokens_per_s, (rl.plan.describe(), exact.plan.describe())


def test_rl_finishes_each_group_alone_that_could_be_the_fastest():
    """Eight A100s and two A100s, a tiny GPT at 16 samples: the greedy policy's plan for the eight (dp2 tp4) is
    slower than its plan for the two, so finishing only the group its plans rank fastest left the answer, the
    eight alone at dp8, unfound (0.94 of the exact search)."""
    mw = mixed([(A, 8), (A, 2)], 16, memory_headroom=0.7)
    exact = search_mixed(mw)
    rl = search_mixed(mw, "rl")
    assert len(exact.plan.lanes) == 1 and exact.plan.gpus() == 8
    assert rl.estimate.tokens_per_s >= 0.97 * exact.estimate.tokens_per_s, (rl.plan.describe(), exact.plan.describe())


def test_rl_weighs_a_pipeline_across_the_groups_where_the_lanes_all_reduce_is_dear():
    """Two groups of two 4090s (one 100 Gb/s NIC per 8 GPUs between them), GPT-2 large at 70% headroom: the
    lanes' cross-group all-reduce is over 10% of their step and one pipeline across both groups wins (1.43x the
    best group alone). rl weighs it there: it gave 0.79 of the exact search when it weighed it only where no
    lane plan fit."""
    mw = mixed([(R, 2), (R, 2)], 8, {"size": "gpt2-large"}, memory_headroom=0.7)
    exact = search_mixed(mw)
    rl = search_mixed(mw, "rl")
    assert exact.plan.lanes[0].spans and rl.plan.lanes[0].spans
    assert rl.estimate.tokens_per_s >= 0.97 * exact.estimate.tokens_per_s


def test_replan_keeps_a_plan_that_still_runs(two_groups):
    mw, result, _ = two_groups
    decided, _ = replan_mixed(result.plan, mw)
    assert decided.decision == "kept" and decided.plan == result.plan
    assert decided.predicted_old_s <= decided.predicted_new_s * 1.05


def test_replan_after_a_group_lost_gpus(two_groups):
    """H100s 2 -> 1: the old lane on two H100s no longer fits the group; the new plan runs on the new mix."""
    _, result, _ = two_groups
    new = mixed([(A, 2), (H, 1)], 32)
    decided, found = replan_mixed(result.plan, new)
    assert decided.decision == "replanned" and decided.predicted_old_s is None
    decided.plan.validate(new)
    assert decided.plan == found.plan and decided.planning_s < 10


def test_replan_onto_the_one_group_left(two_groups):
    """The A100 group leaves: what is left is one GPU type, so the answer is its homogeneous plan."""
    mw, result, _ = two_groups
    left = mw.on_group(H, 2, 32)
    decided, found = replan_mixed(result.plan, left)
    assert found is None and isinstance(decided.plan, Plan) and decided.decision == "replanned"
    decided.plan.validate(left)
    assert "left alone" in decided.reason


def test_replan_keeps_the_global_batch(two_groups):
    _, result, _ = two_groups
    with pytest.raises(PlanError, match="keeps the plan's global batch"):
        replan_mixed(result.plan, mixed([(A, 2), (H, 2)], 64))


def test_cli_replan_from_a_mixed_plan(capsys, tmp_path):
    """`autopar search --cluster NEW --replan-from old.json`: the decision in JSON, the new plan written;
    a --global-batch other than the plan's is one line."""
    old = tmp_path / "old.json"
    code, _, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=tiny", "--cluster", f"{A}:1,{H}:1",
                           "--global-batch", "32", "--method", "rl", "-o", old)
    assert code == 0, err
    new = tmp_path / "new.json"
    code, out, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=tiny", "--cluster", f"{H}:1",
                             "--method", "rl", "--replan-from", old, "-o", new, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["replan"]["decision"] in ("kept", "replanned") and Plan.load(new).global_batch == 32
    if len(MixedPlan.load(old).lanes) > 1:
        assert doc["replan"]["decision"] == "replanned"
    code, out, err = run_cli(capsys, "search", "gpt", "--model-arg", "size=tiny", "--cluster", f"{H}:1",
                             "--global-batch", "64", "--replan-from", old)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "leave --global-batch out" in err, err


@pytest.mark.heavy
def test_the_exact_search_keeps_the_plan_its_pruning_bound_comes_from(monkeypatch):
    """With two groups the exact search prices the proportional split first and skips splits that cannot beat
    it: that split must stay a candidate (it was dropped where its lanes tied the bound: the exact search
    gave 0.71 of rl's step on a held-out workload). Two equal groups: pruning every other split leaves the
    even split, so the lanes are found."""
    monkeypatch.setattr(mixed_search, "_pair_tables",
                        lambda lanes, names, units, *rest: {g: [math.inf] * (units + 1) for g in names})
    result = search_mixed(mixed([(H, 2), (H, 2)], 32))
    assert len(result.plan.lanes) == 2 and result.gain > 1.0
