"""The plan space grows by declaring: a throwaway parallel axis and a throwaway boolean knob,
declared in a fixture, flow through Plan JSON, the exhaustive, random and Optuna planners, the
RL environment's actions and masks, the Why table and the `estimate` flags, with no edit to any
of those modules. Plus the invariants of the one walker and the registry they rely on."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import prefix_before, workload
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import axes
from autopar.cli import main
from autopar.cost import PlanArrays, estimate, evaluate
from autopar.envs.knobs import MAX_ACTIONS, PlanSpace
from autopar.envs.parallel_plan_env import ParallelPlanEnv
from autopar.errors import PlanError
from autopar.explain import explain
from autopar.knobs import Field, Knob, decisions, declare_knob, undeclare_knob
from autopar.plan import Plan
from autopar.search import get_planner
from autopar.search.space import enumerate_plans, sample

XP_SECONDS = 0.01  # per degree of the throwaway axis: the smallest degree that fits is fastest
XK_SECONDS = 0.005  # the throwaway knob off costs this much


def _xp_allowed(w, degree: int):
    return None if w.global_batch % degree == 0 else f"xp={degree} does not divide the global batch"


def _xp_memory(w, pa, c):
    """Twice a GPU's memory over xp squared: xp = 1 never fits, xp = 2 adds half a GPU."""
    return 2 * w.cluster.gpu.memory_bytes / pa.xp.astype(float) ** 2


@pytest.fixture
def declared():
    axis = axes.Axis("xp", "throwaway", 1.5, _xp_allowed, help="a throwaway axis",
                     time_term=lambda w, pa, c: XP_SECONDS * pa.xp, memory_term=_xp_memory)
    knob = Knob("xk", (Field("xk", bool, False),), lambda w, d: [False, True], label="throwaway knob",
                text=lambda v: f"xk {'on' if v else 'off'}", short=lambda v: "xk" if v else None,
                slots=(False, True), time_term=lambda w, pa, c: np.where(pa.xk, 0.0, XK_SECONDS),
                flag_help="a throwaway boolean knob")
    axes.declare_axis(axis)
    declare_knob(knob)
    try:
        yield workload(size="tiny", global_batch=32)  # 8 GPUs: xp in 1, 2, 4, 8
    finally:
        undeclare_knob("xk")
        axes.undeclare("xp")


def test_plan_json_carries_them_and_older_plans_still_read(declared):
    plan = Plan(dp=2, tp=2, pp=1, xp=2, micro_batch_size=4, num_micro_batches=4, xk=True)
    d = json.loads(plan.to_json())
    assert d["xp"] == 2 and d["xk"] is True and d["mesh_order"] == ["pp", "dp", "xp", "cp", "tp"]
    assert Plan.from_json(plan.to_json()) == plan and plan.world_size == 8
    assert plan.describe() == "dp2 tp2 pp1 xp2 mb 4x4 xk"
    older = {"schema_version": 1, "dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_micro_batches": 1,
             "mesh_order": ["pp", "dp", "tp"]}  # written before xp and cp existed
    read = Plan.from_dict(older)
    assert read.xp == 1 and read.xk is False and read.mesh_order == ("pp", "dp", "xp", "cp", "tp")


def test_every_planner_searches_them(declared):
    w = declared
    space = enumerate_plans(w)
    assert set(space.xp.tolist()) == {1, 2, 4, 8} and set(space.xk.tolist()) == {0, 1}
    res = evaluate(w, space)
    assert not res["fits"][space.xp == 1].any() and res["fits"][space.xp == 2].any()
    best = get_planner("exhaustive").propose(w, 1)[0]
    assert best.xp == 2 and best.xk is True  # the smallest degree that fits; the knob on saves time
    # optuna: TPE on this toy space is seed-dependent; with 100 trials seeds 1 and 3-7 reach the optimum
    # (measured with the cuda_graphs knob declared; before it, on the cost model of 3559932, seeds 0-2, 5, 6)
    for method, options in (("random", {"trials": 600, "seed": 0}), ("optuna", {"trials": 100, "progress": False,
                                                                               "seed": 1})):
        plans = get_planner(method, **options).propose(w, 3)
        assert all(p.xp >= 2 for p in plans), method  # xp = 1 never fits: only the memory term says so
        assert plans[0].xk is True, method
    rng = np.random.default_rng(0)
    walked = {(p.xp, p.xk) for p in (sample(w, lambda k, c: int(rng.integers(len(c)))) for _ in range(1500))}
    assert walked == {(x, k) for x in (1, 2, 4, 8) for k in (False, True)}


def test_the_rl_environment_decides_them_under_memory_masks(declared):
    w = declared
    names = [k.name for k in decisions()]
    assert names.index("xp") == names.index("cp") + 1 and names[-1] == "xk"  # declared last of the axes
    env = ParallelPlanEnv([w])
    obs, info = env.reset(seed=0)
    assert env.action_space.n == MAX_ACTIONS and obs.shape == env.observation_space.shape
    space = env.plan_space
    prefix = prefix_before(space, "xp")
    step = space.step(prefix)
    allowed = dict(zip(step.values, step.allowed))
    assert allowed[1] is np.False_ and any(allowed[x] for x in (2, 4, 8))  # xp = 1 masked: it never fits
    rng = np.random.default_rng(1)
    for episode in range(5):
        env.reset(seed=episode)
        done = False
        while not done:
            obs, reward, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        assert info["plan"].xp >= 2 and reward > 0
    plan = info["plan"]
    assert space.plan(space.prefix_of(plan)) == plan


def test_the_why_table_and_estimate_flags_show_them(declared, capsys, tmp_path):
    w = declared
    best = get_planner("exhaustive").propose(w, 1)[0]
    reasons = {r.knob: r for r in explain(w, best)}
    # xp among the degrees, in the plan's words (dp or pp for the rest: the tiny GPT's GEMMs fill few
    # SMs, so which of the two wins is the cost model's call)
    assert best.xp == 2 and reasons["degrees"].chosen == f"dp{best.dp} tp{best.tp} pp{best.pp} xp2"
    assert "other choice(s) do not fit" in reasons["degrees"].text  # the xp = 1 splits
    assert reasons["xk"].chosen == "xk on" and "xk off" in reasons["xk"].text
    est = estimate(w, best)
    assert est.breakdown["xp"] == pytest.approx(XP_SECONDS * 2) and est.breakdown["xk"] == 0.0
    assert est.memory["xp_memory"] == pytest.approx(w.cluster.gpu.memory_bytes / 2)
    code = main(["estimate", "gpt", "--model-arg", "size=tiny", "--dp", "2", "--tp", "1", "--xp", "4",
                 "--micro-batch-size", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["plan"]["xp"] == 4 and out["plan"]["xk"] is False
    assert out["breakdown"]["xk"] == pytest.approx(XK_SECONDS)
    assert main(["estimate", "gpt", "--model-arg", "size=tiny", "--dp", "2", "--xp", "4", "--micro-batch-size",
                 "2", "--xk", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["xk"] is True


def test_the_registry_is_back_to_its_own_after_the_fixture():
    assert "xp" not in axes.AXES and "xk" not in [k.name for k in decisions()]
    assert axes.mesh_orders() == (("pp", "dp", "cp", "tp"), ("pp", "cp", "tp", "dp"))


# -- invariants of the walker and the registry -----------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.sampled_from([1, 2]), batch=st.sampled_from([16, 24, 64]))
def test_a_sampled_plan_survives_json_arrays_and_the_env_prefix(seed, nodes, batch):
    w = workload(size="tiny", nodes=nodes, global_batch=batch)
    rng = np.random.default_rng(seed)
    plan = sample(w, lambda k, c: int(rng.integers(len(c))))
    plan.validate(w)
    assert Plan.from_json(plan.to_json()) == plan
    assert PlanArrays.from_plans([plan], w.profile).plan(0) == plan
    space = PlanSpace(w)
    assert space.plan(space.prefix_of(plan)) == plan


@settings(max_examples=60, deadline=None)
@given(degrees=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=len(axes.AXES), max_size=len(axes.AXES)),
       inner=st.booleans())
def test_strides_make_every_rank_one_coordinate(degrees, inner):
    """Strides of a declared mesh order address each rank exactly once (a mixed-radix number)."""
    order = axes.mesh_orders()[-1 if inner else 0]
    dims = axes.ParallelDims(dict(zip(axes.AXES, degrees)), order)
    strides = dims.strides()
    ranks = {sum(strides[a] * c[a] for a in axes.AXES)
             for c in ({a: (i // s) % dims.degrees[a] for a, s in strides.items()} for i in range(dims.world_size))}
    assert ranks == set(range(dims.world_size)) and strides[order[-1]] == 1


def test_a_folded_axis_splits_the_ranks_of_the_axes_it_folds():
    """Expert parallelism's shape (a throwaway twin of the declared ep): ranks carved out of dp,
    no mesh order of its own."""
    ep = axes.declare_folded(axes.FoldedAxis("xp", "expert", ("dp",)))
    try:
        dims = axes.ParallelDims({"dp": 4, "tp": 2, "pp": 2}, ("pp", "dp", "tp"))
        ep.check(dims.degrees, 2)
        assert ep.stride(dims) == dims.strides()["dp"] == 2
        assert axes.mesh_orders() == (("pp", "dp", "cp", "tp"), ("pp", "cp", "tp", "dp"))
        with pytest.raises(PlanError, match=r"xp=3 must divide dp = 4; use a xp that divides 4"):
            ep.check(dims.degrees, 3)
    finally:
        axes.undeclare("xp")
    assert "xp" not in axes.FOLDED and "ep" in axes.FOLDED
