"""Per-stage plans (issue 41): `stage_recompute` and 0-block end stages in the Plan, its JSON (schema
version 2, version-1 plans still read), its one-line validation and its CLI flag."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.errors import PlanError
from autopar.knobs import decisions, knob
from autopar.plan import Plan
from conftest import ZOO, workload

BASE = dict(dp=1, tp=1, pp=4, micro_batch_size=1, num_micro_batches=4)


def plan(**kw) -> Plan:
    return Plan(**{**BASE, **kw})


def test_per_stage_plan_round_trips_and_reads_sensibly():
    p = plan(layer_split=(0, 3, 3, 2), stage_recompute=("none", "full:2", "selective", "full:1"))
    d = json.loads(p.to_json())
    assert d["schema_version"] == 2 and d["stage_recompute"] == ["none", "full:2", "selective", "full:1"]
    assert d["layer_split"] == [0, 3, 3, 2]
    assert Plan.from_json(p.to_json()) == p
    assert "ac=-/2/sel/1" in p.describe() and "split=0/3/3/2" in p.describe()
    assert knob("stage_recompute").text(p.stage_recompute) == "per stage: none, full:2, selective, full:1"
    assert plan().stage_recompute == () and "ac=" not in plan().describe()  # uniform: as before


def test_version_1_plans_still_read():
    d = json.loads(plan(recompute="full", recompute_blocks=1).to_json())
    d["schema_version"] = 1
    assert Plan.from_dict(d) == plan(recompute="full", recompute_blocks=1)
    with pytest.raises(PlanError, match="schema_version is 3"):
        Plan.from_dict({**d, "schema_version": 3})


def test_stage_recompute_is_not_a_decision():
    k = knob("stage_recompute")
    assert k not in decisions() and k.choices(None, {}) == [()]


@pytest.mark.parametrize("fields, message", [
    (dict(recompute="full", recompute_blocks=1, stage_recompute=("none",) * 4), "give either recompute"),
    (dict(recompute="selective", stage_recompute=("none",) * 4), "give either recompute"),
    (dict(stage_recompute=("none",) * 3), "has 3 entries but pp x virtual_stages = 4"),
    (dict(stage_recompute=("none", "full:0", "none", "none")), "'full:0' is not"),
    (dict(stage_recompute=("none", "full", "none", "none")), "'full' is not"),
    (dict(stage_recompute=("none", "everything", "none", "none")), "'everything' is not"),
    (dict(layer_split=(1, 3, 3, 1), stage_recompute=("none", "full:4", "none", "none")), "holds 3 blocks"),
    (dict(layer_split=(0, 3, 3, 2), stage_recompute=("selective", "none", "none", "none")), "holds no transformer"),
    (dict(layer_split=(0, 3, 3, 2), stage_recompute=("full:1", "none", "none", "none")), "holds no transformer"),
    (dict(layer_split=(2, 0, 3, 3)), "empty middle stage"),
    (dict(layer_split=(2, 3, 3, -1)), "empty middle stage"),
    (dict(pp=1, num_micro_batches=4, layer_split=(0,)), "needs pp >= 2"),
])
def test_bad_per_stage_fields_are_one_line(fields, message):
    with pytest.raises(PlanError, match=message) as e:
        plan(**fields)
    assert "\n" not in str(e.value)


def test_zero_ends_allowed_at_either_end_and_checked_against_the_model():
    w = workload(global_batch=4, nodes=1, gpus_per_node=4, size="tiny")
    n = w.profile.num_layers
    ends = plan(dp=1, pp=4, layer_split=(0, n // 2, n - n // 2 - 1, 1))
    ends.validate(w)
    both = plan(pp=4, layer_split=(0, n // 2, n - n // 2, 0), stage_recompute=("none", "full:1", "selective", "none"))
    both.validate(w)
    with pytest.raises(PlanError, match="sums to"):
        plan(pp=4, layer_split=(0, 1, 1, 0)).validate(w)
    # with a balanced split, K is checked against the balanced stages when the model is known
    too_many = plan(stage_recompute=("none", f"full:{n}", "none", "none"))
    with pytest.raises(PlanError, match=f"holds {n // 4} blocks"):
        too_many.validate(w)


def test_stage_recompute_flag(capsys):
    gpt = str(ZOO / "gpt.py")
    argv = ["estimate", gpt, "--model-arg", "size=tiny", "--dp", "1", "--pp", "2", "--micro-batch-size", "1",
            "--global-batch", "4", "--cluster", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--json"]
    assert main(argv + ["--stage-recompute", "full:1,selective"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["stage_recompute"] == ["full:1", "selective"]
    assert main(argv + ["--stage-recompute", "full:1,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'bogus' is not" in err and "\n" not in err
    assert main(argv + ["--stage-recompute", "none,none", "--recompute", "selective"]) == 2
    assert "give either recompute" in capsys.readouterr().err
