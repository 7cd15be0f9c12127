"""Zero-bubble schedules (zb, zbv, dualpipev): the knob, the V placement shared by the executor and the
cost model, their pricing (cost/zero_bubble.py), the capability rules and the exports. In-process; the
4-rank parity runs are cases of tests/test_executor_plans.py's one job."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import workload
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    generate_rank_to_stage_mapping,
)

from autopar import cost
from autopar.capability import Target, refusal
from autopar.cluster import load_cluster
from autopar.cost import zero_bubble
from autopar.cost.coefficients import Coefficients
from autopar.cost.model import _pipeline
from autopar.errors import PlanError
from autopar.executor.pipeline import schedule_class, stage_ids
from autopar.export import export_plan
from autopar.knobs import SCHEDULES, balanced_split, device_blocks, knob
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.search.space import enumerate_plans
from autopar.traces.vtrain import MODEL_FILE
from autopar.workload import Workload

PP, M = 4, 8


def plan(schedule="1f1b", v=1, **kw) -> Plan:
    base = dict(dp=1, tp=2, pp=PP, micro_batch_size=1, num_micro_batches=16, precision="bf16")
    return Plan(**{**base, **kw}, schedule=schedule, virtual_stages=v)


@pytest.fixture(scope="module")
def gpt():
    return workload("gpt", size="gpt2-medium", global_batch=16)  # 24 blocks, 8 GPUs


def priced(w, plans):
    return cost.evaluate(w, cost.PlanArrays.from_plans(plans, w.profile))


def per_rank(w, p):
    """(J,) the activations of each representative rank, and the ranks."""
    g = cost.PlanArrays.from_plans([p], w.profile)
    return _pipeline(w, g, Coefficients())["activations"][0], g.splits.stacked(g.split)["rank"][0]


# -- the knob --------------------------------------------------------------------------------------
def test_text_forms_parse_and_print_back():
    k = knob("schedule")
    for text, value in (("zb", ("zb", 1)), ("zb:2", ("zb", 2)), ("zbv", ("zbv", 2)), ("dualpipev", ("dualpipev", 2))):
        assert k.parse(text) == value and k.text(value) == text
    with pytest.raises(PlanError, match="integer V"):
        k.parse("zb:x")


@pytest.mark.parametrize("kw,words", [
    (dict(schedule="zbv", v=1), "exactly 2 stages per rank"),
    (dict(schedule="dualpipev", v=3), "exactly 2 stages per rank"),
    (dict(schedule="dualpipev", v=2, num_micro_batches=4, micro_batch_size=4), "at least 8 micro-batches"),
    (dict(schedule="zb", v=2, num_micro_batches=6), "divisible by pp"),
    (dict(schedule="1f1b", v=2), "needs schedule 'interleaved', 'zb', 'zbv' or 'dualpipev'"),
])
def test_bad_combinations_are_one_line_errors(kw, words):
    with pytest.raises(PlanError, match=words) as e:
        plan(**kw)
    assert "\n" not in str(e.value)


# -- the V placement: one declaration for the executor and the cost model ---------------------------
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stage_ids_are_torchs_placement(pp):
    for schedule, style in (("zbv", "v"), ("dualpipev", "v"), ("zb", "loop"), ("interleaved", "loop")):
        p = Plan(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=4 * pp, schedule=schedule, virtual_stages=2)
        torch_map = generate_rank_to_stage_mapping(pp, 2 * pp, style=style)
        assert [stage_ids(p, r) for r in range(pp)] == [torch_map[r] for r in range(pp)], schedule


def test_the_executor_runs_torchs_classes():
    assert [schedule_class(s) for s in SCHEDULES] == [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                                      ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                                                      ScheduleDualPipeV]


def test_the_cost_model_places_a_v_as_the_executor_does(gpt):
    g = cost.PlanArrays.from_plans([plan("zbv", 2), plan("zb", 2)], gpt.profile)
    reps = g.splits.stacked(g.split)
    for i, name in enumerate(("zbv", "zb")):
        counts = dict(zip(reps["rank"][i].astype(int), reps["counts"][i]))
        head_rank = 0 if name == "zbv" else PP - 1  # stage 2pp-1 on rank 0 in a V, on rank pp-1 looped
        assert counts[0][0] == 1 and counts[head_rank][-1] == 1
    assert device_blocks((1, 2, 3, 4, 5, 6, 7, 8), 4, "zbv") == (9, 9, 9, 9)
    assert device_blocks((1, 2, 3, 4, 5, 6, 7, 8), 4, "zb") == (6, 8, 10, 12)


# -- pricing ----------------------------------------------------------------------------------------
def uniform(per_mb=3.0, weight=1.0, backward=2.0):
    """4 equal ranks whose micro-batch is F = B = W = 1 (per_mb 3, backward 2): the paper's case."""
    ones = np.ones((1, PP))
    return per_mb * ones, ones, weight * ones, backward * ones, np.full((1, 1), float(M))


@pytest.mark.parametrize("name,v,bubble", [
    ("zb", 1, 3.0),  # ZB-H1: (p - 1)(F + B - W), a third of 1F1B's (p - 1)(F + B + W) = 9
    ("zb", 2, 1.5),  # over 2 chunks, as interleaving divides it
    ("zbv", 2, 0.0),  # ZB-V: (p - 1)(F + B - 2W) in chunk times: zero when the three are equal
    ("dualpipev", 2, 3.0),  # DualPipeV: (PP/2 - 1)(F&B + B - 3W), chunks of F 1/2, full B 1, W 1/2, F&B = F + B
])
def test_the_bubble_is_the_papers(name, v, bubble):
    per_mb, mult, weight, backward, m = uniform()
    sched = np.full((1, 1), SCHEDULES.index(name))
    got = zero_bubble.pipe(sched, per_mb, mult, weight, backward, m, np.full((1, 1), float(v)))
    assert got[0] == pytest.approx(M * 3.0 + bubble, abs=1e-12)


def test_a_w_larger_than_f_plus_b_fills_no_more_than_the_bubble():
    per_mb, mult, weight, backward, m = uniform(weight=2.0)
    for name in ("zb", "zbv", "dualpipev"):
        sched = np.full((1, 1), SCHEDULES.index(name))
        assert zero_bubble.pipe(sched, per_mb, mult, weight, backward, m, np.full((1, 1), 2.0))[0] == M * 3.0


def test_in_flight_counts_are_the_declared_ones():
    rank = np.arange(PP, dtype=float)[None, :]
    pp, m = np.full((1, 1), float(PP)), np.full((1, 1), float(M))
    one, two = np.ones((1, 1)), np.full((1, 1), 2.0)
    code = lambda s: np.full((1, 1), SCHEDULES.index(s))  # noqa: E731
    kept, deferred = zero_bubble.in_flight(code("zb"), pp, m, one, rank)
    assert kept.tolist() == [[4, 3, 2, 1]] and deferred.tolist() == [[0, 1, 2, 3]]  # 1F1B's, W deferred by r
    kept, deferred = zero_bubble.in_flight(code("zbv"), pp, m, two, rank)
    assert kept.tolist() == [[4, 4, 4, 4]] and deferred.tolist() == [[0, 0, 0, 0]]
    kept, _ = zero_bubble.in_flight(code("dualpipev"), pp, m, two, rank)
    assert kept.tolist() == [[4.5] * 4]  # PP + 1 = 9 chunks
    kept, _ = zero_bubble.in_flight(code("zbv"), pp, np.full((1, 1), 2.0), two, rank)
    assert kept.tolist() == [[2, 2, 2, 2]]  # no more than the micro-batches there are


def test_zb_shrinks_only_the_bubble_of_1f1b(gpt):
    r = priced(gpt, [plan(), plan("zb"), plan("interleaved", 2), plan("zb", 2)])
    for base, zb in ((0, 1), (2, 3)):
        bubble, ratio = r["pp_bubble"], r["pp_bubble"][zb] / r["pp_bubble"][base]
        assert 1 / 3 <= ratio < 0.8  # W fills part of it: a third at most (F = B = W), less as B outgrows W
        assert r["iteration_time"][base] - r["iteration_time"][zb] == pytest.approx(bubble[base] - bubble[zb],
                                                                                    rel=1e-9)
        for part in ("compute", "recompute", "tp_comm", "pp_p2p", "dp_comm", "optimizer"):
            assert r[part][zb] == r[part][base], part


def test_zb_keeps_1f1bs_peak_and_holds_deferred_w_elsewhere(gpt):
    base, ranks = per_rank(gpt, plan())
    zb, _ = per_rank(gpt, plan("zb"))
    assert zb[ranks == 0] == base[ranks == 0]  # rank 0 defers no W
    assert (zb[ranks > 0] > base[ranks > 0]).all() and zb.max() == base.max()
    r = priced(gpt, [plan(), plan("zb")])
    assert r["peak_memory"][0] == r["peak_memory"][1]


@pytest.fixture(scope="module")
def llama():
    return workload("llama", size="small", global_batch=16)  # 12 blocks; fused attention keeps what W reads


@settings(max_examples=80, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb", "zb:2", "zbv", "dualpipev"]),
       pp=st.sampled_from([3, 4, 5, 6]), m_per_pp=st.integers(1, 3), ends=st.integers(0, 2),
       recompute=st.integers(0, 2))
def test_ranks_folded_into_classes_hide_no_ranks_memory(llama, schedule, pp, m_per_pp, ends, recompute):
    """The peak memory of a plan, whose alike pipeline ranks are priced by one representative, is the
    largest over its ranks priced one by one (a RankTable of every rank). Under zb the deferred W passes
    grow with the rank, so with recompute the class's highest rank can be its worst: with light end stages
    (`ends` blocks) a third of these plans were predicted to fit below their worst rank's memory while only
    the class's lowest rank was priced."""
    name, _, chunks = schedule.partition(":")
    v = int(chunks) if chunks else (2 if name in ("interleaved", "zbv", "dualpipev") else 1)
    layers = llama.profile.num_layers
    split = (ends, *balanced_split(layers - 2 * ends, pp - 2), ends) if v == 1 else ()
    kw = dict(recompute="full", recompute_blocks=recompute) if recompute else {}
    w = replace(llama, global_batch=pp * m_per_pp, cluster=load_cluster("dgx-a100-80g", nodes=1, gpus_per_node=pp))
    try:
        p = Plan(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=pp * m_per_pp, schedule=name,
                 virtual_stages=v, layer_split=split, **kw)
        g = cost.PlanArrays.from_plans([p], w.profile)
    except PlanError:  # a schedule's own rule (e.g. dualpipev's micro-batches), or too few blocks
        return
    whole = cost.evaluate(w, g)["peak_memory"][0]
    counts, full, sel = g.splits.per_rank(pp, p.split_for(layers), (), p.schedule)
    table = cost.arrays.RankTable(np.arange(pp)[None, :], counts[None], full[None], sel[None])
    alone = cost.evaluate(w, cost.PlanArrays(dict(g.columns), table))["peak_memory"][0]
    assert whole == pytest.approx(alone, rel=1e-12)


def test_v_shapes_keep_p_and_p_plus_half_micro_batches_on_every_rank(gpt):
    zbv, _ = per_rank(gpt, plan("zbv", 2))
    dpv, _ = per_rank(gpt, plan("dualpipev", 2))
    assert (dpv > zbv).all()  # half a micro-batch more on every rank
    # in flight saturates at pp: 4 and 8 micro-batches of the same size keep as much on every rank
    four, _ = per_rank(gpt, plan("zbv", 2, num_micro_batches=4, micro_batch_size=4))
    eight, _ = per_rank(gpt, plan("zbv", 2, num_micro_batches=8, micro_batch_size=4))
    np.testing.assert_array_equal(four, eight)


# -- capability --------------------------------------------------------------------------------------
def test_megatron_refuses_zero_bubble_in_one_line():
    why = refusal("schedule", Target(runtime="megatron"), "zbv", {})
    assert "Megatron-Core has no zero-bubble" in why and "\n" not in why
    assert refusal("schedule", Target(runtime="megatron"), "interleaved", {}) is None


@pytest.mark.parametrize("decided,words", [
    ({"dp": 2, "zero": 0}, "DDP's reducer"), ({"dp": 2, "zero": 1}, "DDP's reducer"), ({"dp": 2, "zero": 3}, "zero 3"),
])
def test_what_the_executor_cannot_run_is_refused(decided, words):
    for name in ("zb", "zbv", "dualpipev"):
        assert words in refusal("schedule", Target(), name, decided)
    assert refusal("schedule", Target(), "zbv", {"dp": 2, "zero": 2}) is None


def test_selective_recompute_is_refused_in_one_line_under_every_runtime():
    for kw in (dict(recompute="selective"), dict(stage_recompute=("none", "selective", "none", "none"))):
        with pytest.raises(PlanError, match="selective checkpoint allows one backward") as e:
            plan("zb", **kw)
        assert "\n" not in str(e.value)
    plan("zb", recompute="full", recompute_blocks=2)  # full recompute runs (non-reentrant checkpoint)


def test_the_space_offers_them_only_where_they_run():
    w = workload("gpt", cluster="cpu", gpus_per_node=4, global_batch=16, dtype="fp32", size="tiny", dropout=0.0)
    space = enumerate_plans(w)
    zb = np.isin(space.schedule, [SCHEDULES.index(s) for s in ("zb", "zbv", "dualpipev")])
    assert {SCHEDULES[i] for i in np.unique(space.schedule[zb])} == {"zb", "zbv", "dualpipev"}
    assert ((space.zero[zb] == 2) | (space.dp[zb] == 1)).all()
    assert (space.recompute[zb] != 1).all()  # never selective
    megatron = enumerate_plans(replace(w, runtime="megatron"))
    assert not np.isin(megatron.schedule, [SCHEDULES.index(s) for s in ("zb", "zbv", "dualpipev")]).any()


# -- export ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,v,torchtitan", [("zb", 2, "InterleavedZeroBubble"), ("zbv", 2, "ZBVZeroBubble"),
                                                ("dualpipev", 2, "DualPipeV")])
def test_exports(name, v, torchtitan):
    p = Plan(dp=2, tp=1, pp=4, micro_batch_size=1, num_micro_batches=32, zero=2, schedule=name, virtual_stages=v)
    out = export_plan(p, "torchtitan")
    assert f"--parallelism.pipeline_parallel_schedule {torchtitan}" in out.text
    assert not any("schedule" in line for line in out.unexpressed)
    assert any(f"schedule={name}: Megatron-Core has no zero-bubble" in line
               for line in export_plan(p, "megatron").unexpressed)
    assert any(f"schedule={name}" in line for line in export_plan(p, "deepspeed").unexpressed)
    one = export_plan(p.with_(virtual_stages=1) if name == "zb" else p, "torchtitan").unexpressed
    assert any("on 1 stage per rank" in line for line in one) == (name == "zb")


def test_the_timeline_plot_refuses_them_in_one_line():
    from autopar.plots.schedule import simulate

    with pytest.raises(PlanError, match="not zbv"):
        simulate(plan("zbv", 2), {}, {}, {})


def test_a_v_holds_both_tied_copies_on_rank_0_and_all_reduces_none():
    untied = workload("gpt", gpus_per_node=4, global_batch=8, size="tiny")  # 4 blocks: pp 2 x 2 in a V
    w = Workload(profile_model(MODEL_FILE, {"size": "tiny"}, dtype="bf16"), untied.cluster, 8)  # Megatron's GPT ties
    assert w.profile.tied_params > 0
    both = dict(dp=2, tp=1, pp=2, micro_batch_size=1, num_micro_batches=4, zero=2, virtual_stages=2)
    g = cost.PlanArrays.from_plans([Plan(**both, schedule="zbv"), Plan(**both, schedule="zb")], w.profile)
    parts, ranks = _pipeline(w, g, Coefficients()), g.splits.stacked(g.split)["rank"]
    assert (parts["tied_params"][0] == 0).all() and (parts["tied_params"][1] > 0).all()  # looped: both ends reduce
    # rank 0 of the V holds the head's stage too, and with it the second copy of the tied weight
    v_first, looped_first = parts["local_params"][0][ranks[0] == 0][0], parts["local_params"][1][ranks[1] == 0][0]
    assert v_first - looped_first == pytest.approx(w.profile.head.params + w.profile.tied_params, rel=1e-9)
