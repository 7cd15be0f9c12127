"""The per-stage table and Why row of `autopar search` / `autopar explain` (issue 41): every pipeline
rank priced alone by the cost model's own `evaluate` (the figures of the whole plan's representative
ranks, exactly), and the Why row's gain against the best uniform plan of the same outer knobs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import workload

from autopar.cli import main
from autopar.cost import PlanArrays, evaluate
from autopar.plan import Plan
from autopar.stage_table import changes, is_per_stage, rank_rows, stage_reason, stage_table

W = workload("gpt", size="1.7b", nodes=1, global_batch=64)  # 24 blocks, 8 GPUs
OUTER = dict(dp=2, tp=1, pp=4, micro_batch_size=2, num_micro_batches=16)
PER_STAGE = Plan(**OUTER, layer_split=(0, 8, 8, 8), stage_recompute=("none", "full:2", "selective", "none"))


@pytest.mark.parametrize("plan", [
    PER_STAGE,
    Plan(**OUTER, layer_split=(5, 7, 7, 5), recompute="full", recompute_blocks=2),
    Plan(**{**OUTER, "num_micro_batches": 16}, schedule="interleaved", virtual_stages=2,
         layer_split=(0, 3, 3, 3, 3, 3, 3, 6), stage_recompute=("none", "full:1", "selective", "none", "full:3",
                                                                 "none", "selective", "full:2")),
])
def test_each_rank_is_priced_as_the_whole_plan_prices_it(plan):
    rows = rank_rows(W, plan)
    whole = evaluate(W, PlanArrays.from_plans([plan], W.profile), ranks=True)
    reps = PlanArrays.from_plans([plan], W.profile).splits.entries[0]["ranks"]
    for j, rank in enumerate(reps):  # the whole plan's representative ranks: the same figures
        assert rows[rank].time_per_micro_batch_s == pytest.approx(whole["rank_per_mb"][0, j], rel=1e-9)
        assert rows[rank].memory_bytes == pytest.approx(whole["rank_memory"][0, j], rel=1e-9)
    assert max(r.memory_bytes for r in rows) == pytest.approx(whole["peak_memory"][0], rel=1e-9)
    split = plan.split_for(W.profile.num_layers)
    assert [r.stages for r in rows] == [tuple(range(r, plan.stages, plan.pp)) for r in range(plan.pp)]
    assert [b for r in rows for b in r.blocks] == [split[s] for r in rows for s in r.stages]
    assert (rows[0].embedding, rows[-1].head) == (True, True)


def test_the_table_says_each_stage_own_recompute_and_a_uniform_one_once():
    rows = rank_rows(W, PER_STAGE)
    assert [(r.blocks, r.recompute) for r in rows] == [((0,), ("none",)), ((8,), ("full:2",)),
                                                       ((8,), ("selective",)), ((8,), ("none",))]
    uniform = rank_rows(W, Plan(**OUTER, layer_split=(5, 7, 7, 5), recompute="full", recompute_blocks=2))
    assert {r.recompute for r in uniform} == {("full:2 (uniform)",)}
    assert not is_per_stage(W, Plan(**OUTER)) and is_per_stage(W, PER_STAGE)
    assert is_per_stage(W, Plan(**OUTER, layer_split=(5, 7, 7, 5)))


def test_the_why_row_weighs_the_plan_against_the_best_uniform_plan_of_its_outer_knobs():
    (reason,) = stage_reason(W, PER_STAGE)
    uniform = [Plan(**OUTER), Plan(**OUTER, recompute="selective")] + [
        Plan(**OUTER, recompute="full", recompute_blocks=k) for k in range(1, 7)]
    res = evaluate(W, PlanArrays.from_plans([PER_STAGE] + uniform, W.profile))
    best = 1 + int(np.argmin(np.where(res["fits"][1:], res["iteration_time"][1:], np.inf)))
    ratio = res["iteration_time"][0] / res["iteration_time"][best]
    assert reason.knob == "stage_recompute" and reason.chosen == "per-stage choice"
    assert reason.text == (f"per-stage plan: {ratio - 1:.1%} slower than the best uniform plan (balanced split, "
                           "no recompute): stage 0 holds the embedding only, blocks per stage 0/8/8/8 (balanced: "
                           "6/6/6/6), stage 1 recomputes 2 blocks, stage 2 recomputes selectively, stage 3 "
                           "recomputes nothing")
    assert stage_reason(W, Plan(**OUTER)) == []


def test_runs_of_stages_alike_are_said_once():
    plan = Plan(**OUTER, layer_split=(0, 12, 12, 0), stage_recompute=("none", "full:2", "full:2", "none"))
    assert changes(W, plan) == ("stage 0 holds the embedding only, stage 3 holds the head only, blocks per stage "
                                "0/12/12/0 (balanced: 6/6/6/6), stages 1-2 recompute 2 blocks")


def test_explain_prints_the_table_and_its_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    PER_STAGE.save(path)
    args = ["explain", str(path), "gpt", "--model-arg", "size=1.7b", "--nodes", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Per stage" in out and "0 (embedding)" in out and "full:2" in out and "per-stage plan:" in out
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["recompute"] for s in report["stages"]] == [["none"], ["full:2"], ["selective"], ["none"]]
    assert report["stages"][1]["memory_bytes"] == pytest.approx(rank_rows(W, PER_STAGE)[1].memory_bytes)
    assert any(w["knob"] == "stage_recompute" for w in report["why"])
    Plan(**OUTER).save(path)
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"] is None


def test_a_rank_of_many_chunks_folds_its_repeats():
    plan = Plan(**OUTER, schedule="interleaved", virtual_stages=3, stage_recompute=("none",) * 8 + ("selective",) * 4)
    table = stage_table(rank_rows(W, plan), W.memory_budget)
    cells = [list(column.cells) for column in table.columns]
    assert cells[1][0] == "0, 4, 8" and cells[2][0] == "2 x 3 (embedding)"
    assert cells[3][0] == "none x 2, selective"
