"""Every exporter handles every knob and axis of the registries: each one it does not map (its
`MAPS`) it lists (`UNEXPRESSED`), with a rule that names it when a plan moves it from its default.
A knob declared without either is named by `coverage_gaps`, and still in the unexpressed line of a
plan that sets it, so a plan is never silently weakened on the way out."""

from __future__ import annotations

import pytest

from autopar import axes
from autopar.export import FRAMEWORKS, coverage_gaps, export_plan, exporter, plan_knobs
from autopar.knobs import Field, Knob, declare_knob, knobs, undeclare_knob
from autopar.plan import Plan


def test_every_exporter_maps_or_lists_every_knob_and_axis():
    names = set(plan_knobs())
    assert {k.name for k in knobs()} | set(axes.AXES) | set(axes.FOLDED) | {"layer_split"} <= names
    for framework in FRAMEWORKS:
        assert coverage_gaps(framework) == (), framework
        module = exporter(framework)
        unknown = (set(module.MAPS) | set(module.UNEXPRESSED)) - names
        assert not unknown, f"{framework} declares names no knob has: {unknown}"


# plans that move each knob an exporter lists to values some framework cannot express
MOVED = {
    "pp": [dict(pp=2, dp=4)], "cp": [dict(cp=2, dp=4)], "ep": [dict(ep=2)], "tp": [dict(tp=2, dp=4)],
    "micro_batch_size": [dict(tp=2, dp=4, micro_batch_size=2, num_micro_batches=2)], "num_micro_batches": [{}],
    "zero": [dict(zero=1), dict(zero=2), dict(tp=2, dp=4, zero=2)],
    "recompute": [dict(recompute="selective"),
                  dict(pp=2, dp=4, schedule="interleaved", virtual_stages=2, recompute="full", recompute_blocks=3)],
    "bucket_mb": [dict(bucket_mb=100.0)],
    "schedule": [dict(pp=2, dp=4, schedule="gpipe"), dict(pp=2, dp=4, schedule="interleaved", virtual_stages=4)],
    "sequence_parallel": [dict(tp=2, dp=4, sequence_parallel=True)], "grad_comm_dtype": [dict(grad_comm_dtype="fp16")],
    "offload_optimizer": [dict(tp=2, dp=4, zero=3, offload_optimizer=True)], "precision": [dict(precision="fp16")],
    "fp8_recipe": [dict(precision="fp8", fp8_recipe="rowwise")], "compile": [dict(compile=True)],
    "cuda_graphs": [dict(compile=True, cuda_graphs=True)],
    "mesh_order": [dict(mesh_order=("pp", "cp", "tp", "dp"))], "layer_split": [dict(pp=2, dp=4, layer_split=(3, 5))],
    "stage_recompute": [dict(pp=2, dp=4, stage_recompute=("full:1", "selective"))],
    "dp_replicate": [dict(dp_replicate=2, zero=1), dict(dp_replicate=2, zero=3)],
}
BASE = dict(dp=8, micro_batch_size=1, num_micro_batches=4)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_listed_knob_is_named_in_the_unexpressed_line_of_a_plan_that_moves_it(framework):
    module = exporter(framework)
    for name, rule in module.UNEXPRESSED.items():
        lines = [(rule(plan), plan) for plan in (Plan(**{**BASE, **moved}) for moved in MOVED[name])]
        line, plan = next(((line, plan) for line, plan in lines if line), (None, None))
        assert line and line in export_plan(plan, framework).unexpressed, (framework, name)
        if name != "num_micro_batches":  # at the defaults nothing to say (accelerate always names gradient accumulation)
            assert rule(Plan(**BASE)) is None, (framework, name)


@pytest.fixture
def throwaway():
    declare_knob(Knob("xk", (Field("xk", bool, False),), lambda w, d: [False, True], label="throwaway knob",
                      slots=(False, True), flag_help="a throwaway boolean knob"))
    try:
        yield
    finally:
        undeclare_knob("xk")


def test_a_knob_declared_without_either_is_named(throwaway):
    for framework in FRAMEWORKS:
        assert coverage_gaps(framework) == ("xk",), framework
    plan = Plan(dp=8, micro_batch_size=1, num_micro_batches=4, xk=True)
    for framework in FRAMEWORKS:  # never silently dropped meanwhile
        assert f"xk=True: the {framework} exporter does not handle it yet" in export_plan(plan, framework).unexpressed
        assert "xk" not in export_plan(plan.with_(xk=False), framework).unexpressed_line()


def test_a_throwaway_axis_is_named_too():
    axes.declare_axis(axes.Axis("xp", "throwaway", 1.5, help="a throwaway axis"))
    try:
        assert all(coverage_gaps(f) == ("xp",) for f in FRAMEWORKS)
    finally:
        axes.undeclare("xp")
