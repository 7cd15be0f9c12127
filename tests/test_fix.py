"""`autopar search --fix KNOB=VALUE`: the plan space narrowed for every planner, bad fixes refused in
one line before any work, the plan file's record of what was held and chosen, and elastic re-plans
that keep the held and hand-edited knobs (issue 39, point 1)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import ZOO, run_cli, workload

from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan
from autopar.search import get_planner
from autopar.search.fixed import parse_fixes, searched, with_fixes
from autopar.search.replan import Replanner
from autopar.search.space import walk

GPT = str(ZOO / "gpt.py")
TINY_CPU = ["--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "16"]


@pytest.mark.parametrize("fix, message", [
    ("dp=2", "dp is derived"),
    ("foo=1", "unknown knob 'foo'"),
    ("compile=maybe", "expected true or false"),
    ("zero=7", "zero must be one of 0, 1, 2, 3"),
    ("bucket_mb=7", "offers bucket_mb only as one of 5, 25, 100"),
    ("pp=x", "pp takes an integer"),
    ("tp=0", "tp must be a positive integer"),
    ("precision=fp32", "use --precision"),
    ("compile", "expects KNOB=VALUE"),
])
def test_a_bad_fix_is_one_line_and_exit_2_before_the_model_is_read(capsys, tmp_path, fix, message):
    missing = tmp_path / "no_model.py"  # never read: the --fix is refused first
    code, out, err = run_cli(capsys, "search", missing, "--fix", fix, "-o", tmp_path / "plan.json")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "no_model" not in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("fix, held", [("recompute=none", ("none", 0)), ("recompute=selective", ("selective", 0)),
                                       ("recompute=3", ("full", 3)), ("recompute=full", ("full", None))])
def test_every_recompute_setting_can_be_held(fix, held):
    """none and selective hold recompute_blocks at 0, its default (only a degree must be at least 1): the
    planners then return only plans with that setting."""
    assert parse_fixes([fix]) == (("recompute", held),)
    w = with_fixes(workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny"),
                   parse_fixes([fix]))
    for plan in get_planner("exhaustive").propose(w, 3):
        assert plan.recompute == held[0] and (held[1] is None or plan.recompute_blocks == held[1])


def test_one_knob_held_at_two_values_is_refused():
    with pytest.raises(AutoparError, match="holds compile at two values"):
        parse_fixes(["compile=true", "compile=false"])


@pytest.mark.parametrize("fix, message", [
    ("pp=16", "pp=16 exceeds the model's 4 blocks"),
    ("tp=3", "the plan space offers tp = 1, 2"),
])
def test_a_value_this_workloads_space_forbids_is_one_line_and_exit_2(capsys, tmp_path, fix, message):
    code, out, err = run_cli(capsys, "search", GPT, *TINY_CPU, "--fix", fix, "-o", tmp_path / "plan.json")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "plan.json").exists()


def test_a_held_value_the_others_exclude_names_both():
    w = workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny")
    with pytest.raises(AutoparError, match=r"--fix compile=true: no plan .* beside pp=2; the plan space offers "
                                           r"compile = false there"):
        with_fixes(w, parse_fixes(["pp=2", "compile=true"]))


FIXES = ["pp=2", "recompute=full", "schedule=gpipe", "micro_batch_size=2"]


@pytest.mark.parametrize("method", ["exhaustive", "rules", "rl", "optuna", "random"])
def test_every_planner_returns_only_plans_with_the_held_values(method):
    w = with_fixes(workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny"),
                   parse_fixes(FIXES))
    options = {"optuna": {"trials": 30, "progress": False}, "random": {"trials": 30}}.get(method, {})
    plans = get_planner(method, **options).propose(w, 3)
    assert plans
    for p in plans:  # recompute=full: every block of the busiest rank (2 of 4 on pp2)
        assert (p.pp, p.recompute, p.recompute_blocks, p.schedule, p.micro_batch_size) == (2, "full", 2, "gpipe", 2)
        p.validate(w)


def test_a_held_value_some_layouts_cannot_take_leaves_the_rl_masks_working():
    """grad_comm_dtype held at bf16: a layout without data parallelism offers no gradient dtype then, so
    the policy's lean completion of that layout has none (it crashed on min() of nothing). Every step of
    the fastest path through the masks is priced, down to a plan with the held value."""
    from autopar.envs.knobs import PlanSpace

    space = PlanSpace(with_fixes(workload("gpt", global_batch=16, size="tiny"), parse_fixes(["grad_comm_dtype=bf16"])))
    prefix = ()
    while len(prefix) < len(space.names):
        info = space.step(prefix)
        assert info.allowed.any()
        prefix += (info.values[int(np.argmin(np.where(info.allowed, info.time, np.inf)))],)
    plan = space.plan(prefix)
    assert plan.grad_comm_dtype == "bf16" and plan.dp > 1


def test_unheld_the_planners_choose_otherwise():
    """The held values above are not what the search picks anyway (the test above would prove nothing)."""
    best = get_planner("exhaustive").propose(workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32",
                                                      size="tiny"), 1)[0]
    assert (best.pp, best.recompute, best.schedule == "gpipe" and best.pp > 1) == (1, "none", False)


def test_the_walk_and_the_rl_masks_see_the_held_space():
    from autopar.envs.knobs import PlanSpace

    base = workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny")
    held = with_fixes(base, parse_fixes(["tp=2", "zero=0"]))
    w = walk(held)
    assert w.size and set(w.values["tp"]) == {2} and set(w.values["zero"]) <= {0}
    assert walk(base).size > w.size
    space = PlanSpace(held)
    step = space.step(())  # the first decision: tp, with only 2 allowed
    assert [v for v, ok in zip(step.values, step.allowed) if ok] == [2]


def test_search_records_the_held_knobs_in_the_plan_file(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "search", GPT, *TINY_CPU, "--method", "exhaustive", "--fix", "zero=0",
                           "--fix", "compile=true", "-o", out_path, "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["plan"]["zero"], d["plan"]["compile"]) == (0, True)
    saved = json.loads(out_path.read_text())
    assert saved["fixed"] == ["zero", "compile"] and saved["searched"]["compile"] is True
    plan = Plan.load(out_path)
    assert plan == Plan.from_dict(d["plan"]) and plan.kept() == ("zero", "compile")
    assert saved["cluster"] == "cpu" and plan.searched_on == "cpu"
    assert Plan.from_dict(plan.to_dict()).searched_on == "cpu"


def test_pricing_a_plan_on_another_cluster_than_its_search_says_so(capsys, tmp_path):
    """The plan records the --cluster it was searched for; explain, estimate and memory on another say so on
    stderr (one line; stdout's JSON stays clean), and nothing where they are the same."""
    out_path = tmp_path / "plan.json"
    assert run_cli(capsys, "search", GPT, *TINY_CPU, "-o", out_path)[0] == 0
    for command in (["explain", out_path, GPT, "--model-arg", "size=tiny"],
                    ["estimate", GPT, "--model-arg", "size=tiny", "--plan", out_path],
                    ["memory", GPT, "--model-arg", "size=tiny", "--plan", out_path]):
        code, out, err = run_cli(capsys, *command, "--json")
        assert code == 0 and json.loads(out)
        assert err == ("autopar: note: the plan was searched for --cluster cpu; this prices it on dgx-a100-80g "
                       "(pass --cluster cpu to price it where it was planned)\n")
        code, out, err = run_cli(capsys, *command, "--cluster", "cpu", "--json")
        assert code == 0 and err == ""
    with pytest.raises(PlanError, match="plan key 'cluster' must be the --cluster"):
        Plan.from_dict({**Plan.load(out_path).to_dict(), "cluster": 3})


# -- elastic re-plans ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replanner():
    return Replanner(GPT, {"size": "tiny"}, cluster="cpu", gpus_per_node=2, tolerance=0.0, method="exhaustive")


BASE = Plan(dp=2, micro_batch_size=8, num_micro_batches=1, precision="fp32")


def test_a_replan_keeps_a_knob_the_search_held(replanner):
    old = searched(BASE.with_(compile=True), (("compile", True),))  # `search --fix compile=true`
    d = replanner(old, 4)
    assert d.plan.world_size == 4 and d.plan.compile and "compile" in d.plan.fixed
    free = replanner(searched(BASE.with_(compile=True), ()), 4)  # not held: the cpu preset's search drops it
    assert not free.plan.compile


def test_a_replan_keeps_a_knob_edited_by_hand_in_the_plan_file(replanner, tmp_path):
    path = tmp_path / "plan.json"
    searched(BASE, ()).save(path)
    d = json.loads(path.read_text())
    d.update(recompute="full", recompute_blocks=4)  # the user's edit: full recompute, which no search picks here
    path.write_text(json.dumps(d))
    edited = Plan.load(path)
    assert edited.kept() == ("recompute",)
    new = replanner(edited, 4)
    assert (new.plan.recompute, new.plan.recompute_blocks) == ("full", 4) and new.plan.fixed == ("recompute",)
    assert "kept recompute" in new.reason
    again = replanner(Plan.from_dict(new.plan.to_dict()), 2)  # through latest.json: a later re-plan keeps it too
    assert again.plan.recompute == "full"
    unedited = replanner(Plan.load(path).with_(recompute="none", recompute_blocks=0), 4)
    assert unedited.plan.recompute == "none"


def test_a_replan_that_cannot_keep_a_held_degree_says_so(replanner):
    old = searched(Plan(pp=2, micro_batch_size=8, num_micro_batches=2, precision="fp32"), (("pp", 2),))
    with pytest.raises(AutoparError, match="no plan for 1 ranks keeping pp=2"):
        replanner(old, 1)


def test_plan_file_record_is_checked():
    d = searched(BASE, (("zero", 0),)).to_dict()
    for bad in ({"fixed": ["dp"]}, {"fixed": "zero"}, {"searched": {"nope": 1}}):
        with pytest.raises(AutoparError):
            Plan.from_dict({**d, **bad})
    plain = BASE.to_dict()
    assert "fixed" not in plain and "searched" not in plain  # a plan without a record reads as before
    assert dataclasses.replace(workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny"),
                               fixed=()).fixed == ()
