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


def _priced(w, plans):
    from autopar.cost import PlanArrays, evaluate

    return evaluate(w, PlanArrays.from_plans(plans, w.profile), ranks=True)


def test_per_stage_recompute_prices_as_its_uniform_equivalent_and_per_rank():
    from autopar.knobs import balanced_split

    w = workload(global_batch=8, nodes=1, gpus_per_node=4, size="tiny")
    split = balanced_split(w.profile.num_layers, 4)
    base = dict(pp=4, num_micro_batches=8)
    pairs = [(plan(**base, recompute="full", recompute_blocks=max(split)),
              plan(**base, stage_recompute=tuple(f"full:{n}" for n in split))),
             (plan(**base, recompute="selective"), plan(**base, stage_recompute=("selective",) * 4)),
             (plan(**base), plan(**base, stage_recompute=("none",) * 4))]
    r = _priced(w, [p for pair in pairs for p in pair])
    for name in ("iteration_time", "peak_memory", "recompute", "activations"):
        assert r[name][0::2] == pytest.approx(r[name][1::2], rel=1e-12), name
    # one stage recomputed: that rank alone pays the recompute and keeps less
    one = plan(**base, stage_recompute=("full:1", "none", "none", "none"))
    r = _priced(w, [plan(**base), one])
    assert r["rank_per_mb"][1, 0] > r["rank_per_mb"][0, 0] and r["rank_memory"][1, 0] < r["rank_memory"][0, 0]
    assert r["rank_per_mb"][1, 1:] == pytest.approx(r["rank_per_mb"][0, 1:])
    assert r["hw_flops"][1] > r["hw_flops"][0]


def test_end_only_stages_are_priced():
    w = workload(global_batch=8, nodes=1, gpus_per_node=4, size="tiny")
    n = w.profile.num_layers
    base = dict(pp=4, num_micro_batches=8)
    embed_only = plan(**base, layer_split=(0, n // 3, n // 3, n - 2 * (n // 3)))
    head_only = plan(**base, layer_split=(n // 3, n // 3, n - 2 * (n // 3), 0))
    r = _priced(w, [plan(**base), embed_only, head_only])
    ranks = r["rank_per_mb"]
    # the end-only rank holds no block: its micro-batch is the embedding's (or head's) alone, and the ranks
    # that took its blocks are slower
    assert ranks[1, 0] < ranks[0, 0] and ranks[2].max() > ranks[0].max()
    assert r["rank_memory"][1, 0] < r["rank_memory"][0, 0]
    assert (r["iteration_time"][1:] > r["iteration_time"][0]).all()  # the tiny model's ends are cheap
