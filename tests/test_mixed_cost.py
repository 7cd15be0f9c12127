"""The cost of a mixed plan (autopar/mixed/cost.py): a lane on one group is the homogeneous estimate to
the last bit, a lane spanning groups composes per-rank figures of the homogeneous model, the lanes add
the cross-lane gradient all-reduce, and no mixed plan beats the published-MFU bound (issue 42, acceptance 1)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from conftest import profile, run_cli
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autopar.cluster.mixed import parse_mixed_spec
from autopar.cost import Coefficients, estimate
from autopar.cost.published_mfu import best_published
from autopar.cost.regime import attention_fused
from autopar.errors import PlanError
from autopar.knobs import DTYPE_BYTES
from autopar.mixed.cost import cross_sync, estimate_mixed, lane_time, price_lane
from autopar.mixed.plan import Lane, MixedPlan, Segment
from autopar.mixed.why import why_rows, why_table
from autopar.mixed.workload import MixedWorkload
from autopar.plan import Plan

A, H, R = "dgx-a100-80g", "dgx-h100", "pcie-4090x8"
MODEL = {"size": "1.7b"}  # 24 blocks, 24 heads: tp 1..8 all divide


def mixed(spec: str, batch: int = 64) -> MixedWorkload:
    return MixedWorkload(profile("gpt", **MODEL), parse_mixed_spec(spec), batch)


@pytest.fixture(scope="module")
def mw():
    return mixed(f"{A}:2,{H}:1")


ONE_GROUP = [  # (group, plan): lanes of one group at share 32 (16 A100s: whole nodes)
    (A, dict(dp=16, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2)),
    (A, dict(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=8, zero=1, recompute="full", recompute_blocks=6)),
    (H, dict(dp=1, tp=4, pp=2, micro_batch_size=1, num_micro_batches=32, schedule="interleaved", virtual_stages=2)),
    (H, dict(dp=4, tp=2, pp=1, micro_batch_size=2, num_micro_batches=4, zero=3, sequence_parallel=True)),
]


@pytest.mark.parametrize("group,fields", ONE_GROUP)
def test_a_lane_on_one_group_is_the_homogeneous_estimate_exactly(mw, group, fields):
    plan = Plan(**fields)
    lane = Lane((Segment(group, plan.tp, plan.pp),), plan)
    homogeneous = estimate(mw.on_group(group, lane.gpus(), lane.share), plan)
    priced = price_lane(mw, lane)
    assert priced.estimate == homogeneous  # every figure, to the last bit
    assert priced.iteration_time_s == homogeneous.iteration_time_s
    assert priced.segments[0].peak_memory_bytes == homogeneous.peak_memory_bytes
    assert lane_time(mw, lane, lane.share) == (homogeneous.iteration_time_s if homogeneous.fits else math.inf)
    alone = estimate_mixed(replace(mw, global_batch=lane.share), MixedPlan((lane,)))  # one lane: no cross sync
    assert (alone.iteration_time_s, alone.tokens_per_s) == (homogeneous.iteration_time_s, homogeneous.tokens_per_s)
    assert alone.mfu == pytest.approx(homogeneous.mfu, rel=1e-12)  # the same quotient, divided in another order


def test_a_lane_split_into_segments_of_one_group_prices_as_the_whole(mw):
    """The per-rank composition of a spanning lane, with no group boundary, is the homogeneous model's."""
    plan = Plan(dp=2, tp=2, pp=4, micro_batch_size=1, num_micro_batches=16, layer_split=(5, 7, 6, 6),
                stage_recompute=("none", "full:3", "selective", "none"))
    whole = estimate(mw.on_group(A, 16, 32), plan)
    split = price_lane(mw, Lane((Segment(A, 2, 1), Segment(A, 2, 3)), plan))
    assert split.iteration_time_s == pytest.approx(whole.iteration_time_s, rel=1e-12)
    assert max(s.peak_memory_bytes for s in split.segments) == pytest.approx(whole.peak_memory_bytes, rel=1e-12)
    assert [s.blocks for s in split.segments] == [5, 19] and all(s.send_s == 0 for s in split.segments)


def test_sends_across_groups_are_priced_on_the_link(mw):
    plan = Plan(dp=1, tp=2, pp=3, micro_batch_size=1, num_micro_batches=32)
    lane = Lane((Segment(H, 2, 1), Segment(A, 2, 1), Segment(H, 2, 1)), plan)
    fast = price_lane(mw, lane)
    assert all(s.send_s > 0 for s in fast.segments)  # each borders another group
    edge = Lane((Segment(H, 2, 2), Segment(A, 2, 1)), plan)
    assert price_lane(mw, edge).segments[0].send_s > 0
    slow_mw = replace(mw, cluster=replace(mw.cluster, link=replace(mw.cluster.link,
                                                                     bandwidth=mw.cluster.link.bandwidth / 8)))
    slow = price_lane(slow_mw, lane)
    assert slow.iteration_time_s > fast.iteration_time_s
    assert all(s.send_s > f.send_s for s, f in zip(slow.segments, fast.segments))


def test_each_segment_is_held_to_its_own_groups_memory():
    mw = mixed(f"{R}:1,{A}:1", 32)
    plan = Plan(dp=1, tp=1, pp=2, micro_batch_size=4, num_micro_batches=8)
    priced = price_lane(mw, Lane((Segment(R, 1, 1), Segment(A, 1, 1)), plan))
    budgets = [s.usable_memory_bytes for s in priced.segments]
    assert budgets == [mw.on_group(R, 1, 32).memory_budget, mw.on_group(A, 1, 32).memory_budget]
    assert budgets[0] < budgets[1]
    assert priced.segments[0].fits != priced.segments[1].fits  # the 4090's 24 GB cannot hold what the A100 can
    assert not priced.fits and lane_time(mw, priced.lane) == math.inf


def test_the_step_is_the_slowest_lane_plus_the_cross_lane_all_reduce(mw):
    a = Lane((Segment(A, 1, 1),), Plan(dp=16, tp=1, pp=1, micro_batch_size=1, num_micro_batches=3))
    h = Lane((Segment(H, 1, 1),), Plan(dp=8, tp=1, pp=1, micro_batch_size=2, num_micro_batches=1))
    mp = MixedPlan((a, h))
    est = estimate_mixed(mw, mp)
    sync = est.cross_sync_s
    link = mw.cluster.link
    coeffs = [Coefficients.for_cluster(mw.cluster.group(g), mw.runtime) for g in (A, H)]
    nbytes = mw.profile.params * DTYPE_BYTES[a.plan.grad_comm_dtype]  # the gradients as reduced
    expected = (2 * (2 - 1) / 2 * nbytes / (8 * link.bandwidth * min(c.link(link.kind) for c in coeffs))
                + 2 * link.latency * max(c.latency_scale for c in coeffs))
    assert sync == pytest.approx(expected, rel=1e-12) and sync > 0
    assert est.iteration_time_s == max(lane.iteration_time_s for lane in est.lanes) + sync
    assert cross_sync(mw, (a,)) == 0.0
    assert est.tokens_per_s == pytest.approx(64 * mw.profile.seq_len / est.iteration_time_s)
    assert est.model_flops == pytest.approx(sum(lane.model_flops for lane in est.lanes))
    assert est.num_gpus == 24 and est.idle == ()
    json.dumps(est.to_dict())
    with pytest.raises(PlanError, match="not 7"):
        lane_time(mw, a, 7)


@st.composite
def mixed_plans(draw):
    """A valid mixed plan on dgx-a100-80g:1,dgx-h100:1 (8 + 8 GPUs), global batch 64: one or two lanes,
    each on one group or spanning both."""
    lanes = draw(st.integers(1, 2))
    shares = [64] if lanes == 1 else [s := draw(st.sampled_from([8, 16, 24, 32, 40, 48, 56])), 64 - s]
    out = []
    for share in shares:
        groups = draw(st.sampled_from([(A,), (H,), (A, H), (H, A)]))
        tps = [draw(st.sampled_from([1, 2, 4, 8])) for _ in groups]
        stages = [draw(st.integers(1, 2)) for _ in groups]
        dp = draw(st.sampled_from([1, 2]))
        mbs = draw(st.sampled_from([1, 2]))
        pp = sum(stages)
        schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
        recompute = draw(st.sampled_from(["none", "selective"]))
        plan = Plan(dp=dp, tp=tps[0], pp=pp, micro_batch_size=mbs, num_micro_batches=share // (dp * mbs),
                    schedule=schedule, recompute=recompute)
        out.append(Lane(tuple(Segment(g, t, s) for g, t, s in zip(groups, tps, stages)), plan))
    return MixedPlan(tuple(out))


@pytest.fixture(scope="module")
def small_mw():
    return mixed(f"{A}:1,{H}:1")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                  HealthCheck.function_scoped_fixture])
@given(mp=mixed_plans())
def test_no_mixed_plan_beats_the_published_mfu_bound(small_mw, mp):
    """Acceptance 1's upper bound: model FLOP/s <= sum over the used GPUs of peak x the best published MFU
    of their type (autopar/cost/published_mfu.py), whatever the plan."""
    mw = small_mw
    try:
        mp.validate(mw)
    except PlanError:
        assume(False)
    est = estimate_mixed(mw, mp)
    bound = 0.0
    for lane in est.lanes:
        for s in lane.segments:
            gpu = mw.cluster.group(s.group).gpu
            w = mw.on_group(s.group, 1, 1)
            precision = lane.lane.plan.precision
            # nothing published unfused on the H100: its flash row bounds an unfused kernel too
            row = (best_published(gpu.name, w.runtime, precision, "flash" if attention_fused(w) else "unfused")
                   or best_published(gpu.name, w.runtime, precision, "flash"))
            bound += s.gpus * gpu.peak_flops[lane.lane.plan.precision] * row.mfu
    assert est.model_flops / est.iteration_time_s <= bound
    assert est.tokens_per_s <= bound / (est.model_flops / mw.tokens_per_batch)  # the same, in tokens/s
    assert 0 < est.mfu < 1


def test_why_rows_say_why_each_lane_got_its_share_and_why_a_group_is_idle():
    mw = mixed(f"{A}:1,{H}:1,{R}:1")
    a = Lane((Segment(A, 1, 1),), Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2))
    span = Lane((Segment(H, 1, 1), Segment(A, 1, 1)), Plan(dp=1, tp=1, pp=2, micro_batch_size=1, num_micro_batches=48))
    mp = MixedPlan((a, span))
    with pytest.raises(PlanError, match="puts 9 GPUs on group dgx-a100-80g"):
        mp.validate(mw)
    a = Lane((Segment(A, 1, 1),), Plan(dp=4, tp=1, pp=1, micro_batch_size=1, num_micro_batches=4))
    mp = MixedPlan((a, span))
    est = estimate_mixed(mw, mp)
    rows = why_rows(mw, est, alone={R: 1234.0})
    assert [(r.lane, r.group) for r in rows] == [("1", A), ("2", H), ("2", A), ("-", R)]
    slowest = max(est.lanes, key=lambda lane: lane.iteration_time_s)
    lane_of_slowest = str(est.lanes.index(slowest) + 1)
    assert "it is the slowest lane" in next(r.why for r in rows if r.lane == lane_of_slowest)
    assert "share 16/64 (25%)" in rows[0].why and "share 48/64 (75%)" in rows[1].why
    assert "blocks over 1 stage" in rows[2].why and "send across the group boundary" in rows[2].why
    idle = rows[3]
    assert idle.share == "0" and "idle: a lane on its 8 GPUs would add" in idle.why and "1,234 tokens/s" in idle.why
    table, lines = why_table(mw, est)
    assert table.row_count == 4 and len(lines) == 4 and all("\n" not in line for line in lines)


def test_cli_estimate_of_a_mixed_plan(capsys, tmp_path, mw):
    mp = MixedPlan((Lane((Segment(A, 1, 1),), Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=4)),
                    Lane((Segment(H, 2, 1), Segment(A, 2, 1)),
                         Plan(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=8))))
    path = tmp_path / "mixed.json"
    mp.save(path)
    cluster = ["--cluster", f"{A}:2,{H}:1"]
    model = ["gpt", "--model-arg", "size=1.7b"]
    code, out, err = run_cli(capsys, "estimate", *model, *cluster, "--plan", path)
    assert code == 0, err
    assert "cross-lane all-reduce" in out and "Why (mixed plan)" in out and "lane 2 dgx-h100:" in out
    code, out, err = run_cli(capsys, "estimate", *model, *cluster, "--plan", path, "--json")
    assert code == 0, err
    doc = json.loads(out)
    est = estimate_mixed(replace(mw, global_batch=mp.global_batch), mp)
    assert doc["tokens_per_s"] == pytest.approx(est.tokens_per_s, rel=1e-12)
    assert MixedPlan.from_dict(doc["plan"]) == mp
    for argv, match in [((*model, "--cluster", A, "--plan", path), "is a mixed plan over groups"),
                        ((*model, *cluster, "--dp", "8", "--micro-batch-size", "1"), "give a mixed plan"),
                        ((*model, *cluster, "--plan", path, "--global-batch", "8"), "but the global batch is 8"),
                        ((*model, *cluster, "--plan", path, "--nodes", "2"), "cannot resize a mixed cluster")]:
        code, out, err = run_cli(capsys, "estimate", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and match in err, err
