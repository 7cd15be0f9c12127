"""Issue 42: `autopar run mixed.json --elastic` re-plans for a change of GPU mix.

In-process: the ranks numbered group by group from their declared groups, the new mix as the planner
sees it, the mixed re-planner onto the group left, a one-rank job whose group changes twice (a mixed
plan's checkpoint loaded under a homogeneous plan and back, the losses those of a straight run), and
the one-line refusals. ONE real torchrun run (slow, procs): a pipeline over two single-node groups, the
agent of one group killed, the job re-planned onto the group left, its losses a straight run's.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, profile, run_cli

from autopar.cluster.mixed import load_any_cluster
from autopar.errors import AutoparError, PlanError
from autopar.executor.elastic import JobDir, train_elastic
from autopar.executor.mixed_layout import Mix, one_lane, plan_ranks, rank_labels
from autopar.executor.parity import reference_losses, without_dropout
from autopar.executor.worker import step_batch
from autopar.mixed.plan import Lane, MixedPlan, Segment
from autopar.mixed.replan import MixReplanner, mix_workload
from autopar.mixed.workload import MixedWorkload
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.replan import ReplanDecision, ReplanRecord
from autopar.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
A, H = "dgx-a100-80g", "dgx-h100"
CLUSTER = f"{A}:1,{H}:1"
TINY = {"size": "tiny"}
MODEL = load_model_file("gpt")
spec = importlib.util.spec_from_file_location("elastic_campaign", ROOT / "experiments" / "elastic_campaign.py")
campaign = importlib.util.module_from_spec(spec)
spec.loader.exec_module(campaign)


def on(group: str, **plan) -> MixedPlan:
    """One data-parallel lane on `group` (one rank unless dp says otherwise)."""
    knobs = Plan(precision="fp32", **plan)
    return MixedPlan((Lane((Segment(group, knobs.tp, knobs.pp),), knobs),))


# -- the ranks and the new mix ------------------------------------------------------------------------
def test_ranks_are_numbered_group_by_group_whatever_order_torchrun_gave():
    needed = [A, A, H, H]
    assert plan_ranks(needed, [H, H, A, A]) == [2, 3, 0, 1]  # each node's ranks stay contiguous
    assert plan_ranks(needed, [A, A, H, H]) == [0, 1, 2, 3]
    assert plan_ranks(needed, [A, H, A, H]) == [0, 2, 1, 3]
    with pytest.raises(PlanError, match=f"runs on 2 {A} \\+ 2 {H} but the ranks running are 3 {A} \\+ 1 {H}"):
        plan_ranks(needed, [A, A, A, H])


def test_the_new_mix_keeps_each_groups_hardware_and_the_link_and_sizes_nodes_by_their_ranks():
    original = load_any_cluster(f"{A}:2,{H}:1")
    p = profile("gpt", dtype="fp32", **TINY)
    mw = mix_workload(p, original, Mix((H, H, A, A, A, A), (2, 2, 2, 2, 2, 2)), 8)
    assert isinstance(mw, MixedWorkload) and mw.cluster.group_names == (A, H)  # the cluster's order
    assert [(g.nodes, g.gpus_per_node) for g in mw.cluster.groups] == [(2, 2), (1, 2)]
    assert mw.cluster.link == original.link and mw.cluster.group(A).gpu == original.group(A).gpu
    left = mix_workload(p, original, Mix((H,), (1,)), 8)
    assert isinstance(left, Workload) and left.cluster.name == H and left.cluster.num_gpus == 1
    with pytest.raises(PlanError, match="declared group 'pcie-4090x8', which .* does not have; give --node-group "
                                        f"one of {A}, {H}"):
        mix_workload(p, original, Mix(("pcie-4090x8",), (1,)), 8)


def test_the_mixed_replanner_moves_a_pipeline_onto_the_group_left():
    old = MixedPlan((Lane((Segment(A, 1, 1), Segment(H, 1, 1)),
                          Plan(pp=2, micro_batch_size=2, num_micro_batches=2, precision="fp32")),))
    decided = MixReplanner("gpt", TINY, CLUSTER, "gloo")(old, Mix((H,), (1,)))
    assert isinstance(decided.plan, Plan) and decided.plan.world_size == 1 and decided.plan.global_batch == 4
    assert decided.decision == "replanned" and "left alone" in decided.reason
    with pytest.raises(PlanError, match="is one group"):
        MixReplanner("gpt", TINY, A, "gloo")(old, Mix((H,), (1,)))


def test_a_replan_uses_every_group_whose_ranks_run():
    """One A100 and one H100 left of a job on one A100 and two H100s: for the tiny GPT the search's best is the
    H100 alone, which would leave the A100 rank idle (the job cannot drop a running rank); the re-planner
    weighs only plans over both groups (`search_mixed`'s every_group), and one of them runs on every rank."""
    from autopar.mixed.search import search_mixed

    old = MixedPlan((on(A, micro_batch_size=2).lanes[0], on(H, dp=2, micro_batch_size=3).lanes[0]))
    workload = mix_workload(profile("gpt", dtype="fp32", **TINY), load_any_cluster(f"{A}:1,{H}:2"),
                            Mix((A, H), (1, 1)), old.global_batch)
    assert search_mixed(workload, "rl").plan.groups == (H,)  # free, the H100 alone
    decided = MixReplanner("gpt", TINY, f"{A}:1,{H}:2", "gloo")(old, Mix((A, H), (1, 1)))
    assert isinstance(decided.plan, MixedPlan) and decided.decision == "replanned"
    assert sorted(label.group for label in rank_labels(decided.plan)) == [A, H]


def test_a_replan_record_of_a_mixed_job_says_the_groups_and_old_records_still_load():
    fields = {"world_before": 2, "world_after": 1, "old_plan": {}, "new_plan": {}, "decision": "replanned",
              "reason": "r", "resumed_step": 4, "steps_lost": 1, "global_batch_before": 4, "global_batch_after": 4,
              "planning_s": 0.5, "checkpoint_load_s": 0.2}
    assert ReplanRecord.from_dict(fields).mix_after is None  # a record written before mixed jobs
    record = ReplanRecord(**fields, mix_before={A: 1, H: 1}, mix_after={H: 1})
    assert record.describe().startswith(f"1 {A} + 1 {H} -> 1 {H} ranks at step 4: replanned")


# -- one rank whose group changes: a mixed plan's checkpoint under a homogeneous plan, and back --------------
def _job(folder, plan, group: str, steps: int, replan=None):
    try:
        return train_elastic(plan, lambda: without_dropout(MODEL.build(**TINY)),
                             lambda ps: torch.optim.AdamW(ps, lr=1e-3), MODEL.loss_fn,
                             lambda step, batch: step_batch(MODEL, TINY, 0, step, batch), checkpoint_dir=folder,
                             steps=steps, checkpoint_every=2, replan=replan, node_group=group, backend="gloo")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_change_of_group_replans_loads_the_checkpoint_across_kinds_and_continues_like_a_straight_run(tmp_path):
    asked = []

    def replan(old, mix):
        asked.append((old, mix.ranks()))
        new = Plan(micro_batch_size=1, num_micro_batches=4, precision="fp32") if mix.groups == (H,) else \
            on(A, micro_batch_size=4, num_micro_batches=1)
        return ReplanDecision(new, "replanned", "test", 0.1)

    start = on(A, micro_batch_size=2, num_micro_batches=2)
    first = _job(tmp_path, start, A, 2, replan)
    assert first.replan is None and first.first_step == 0 and asked == []
    second = _job(tmp_path, start, H, 4, replan)  # the A100 node left, an H100 node came: one H100 rank
    assert asked == [(start, {H: 1})] and isinstance(second.plan, Plan) and second.first_step == 2
    third = _job(tmp_path, start, A, 6, replan)  # and back: the homogeneous plan re-planned as one lane on H
    assert asked[1] == (one_lane(second.plan, H), {A: 1}) and third.plan == on(A, micro_batch_size=4,
                                                                                num_micro_batches=1)
    assert [(r.mix_before, r.mix_after) for r in JobDir(tmp_path).replans()] == [({A: 1}, {H: 1}), ({H: 1}, {A: 1})]
    assert JobDir(tmp_path).latest()["mix"] == {A: 1}
    losses = JobDir(tmp_path).losses()
    straight = reference_losses(lambda: without_dropout(MODEL.build(**TINY)), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                MODEL.loss_fn, [step_batch(MODEL, TINY, 0, s, 4) for s in range(6)])
    assert list(losses) == list(range(6))
    assert max(abs(losses[s][0] - straight[s]) for s in range(6)) <= 1e-5


def test_a_job_started_on_ranks_of_another_mix_without_a_replanner_is_one_line(tmp_path):
    with pytest.raises(PlanError, match=f"the last plan is for 1 {A} ranks but 1 {H} are running and no replan"):
        _job(tmp_path, on(A, micro_batch_size=2), H, 2)
    _job(tmp_path / "mixed", on(A, micro_batch_size=2), A, 2)
    with pytest.raises(PlanError, match="saved under a mixed plan; continue the job with the mixed plan"):
        _job(tmp_path / "mixed", Plan(micro_batch_size=2, precision="fp32"), None, 4)


# -- refusals before launch ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags,message", [
    (["--cluster", CLUSTER, "--elastic", "--checkpoint-dir", "{d}/job"],
     "--elastic with a mixed plan needs --node-group"),
    (["--cluster", CLUSTER, "--elastic", "--checkpoint-dir", "{d}/job", "--node-group", "pcie-4090x8"],
     f"--node-group pcie-4090x8 is not a group of --cluster {CLUSTER}"),
    (["--cluster", CLUSTER, "--node-group", A], "--node-group needs --elastic"),
])
def test_a_mixed_elastic_run_refuses_in_one_line(tmp_path, capsys, flags, message):
    on(A, micro_batch_size=2).to_json(tmp_path / "mixed.json")
    code, _, err = run_cli(capsys, "run", tmp_path / "mixed.json", "gpt", "--model-arg", "size=tiny", "--backend",
                           "gloo", *[f.format(d=tmp_path) for f in flags])
    err = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "job").exists()


def test_on_nccl_a_nodes_group_defaults_to_the_group_of_its_gpu_model(monkeypatch):
    """Checked against a stand-in for torch's device query (no GPU here; unverified on a mixed machine)."""
    from types import SimpleNamespace

    from autopar.executor.options import ElasticSpec, RunOptions
    from autopar.traces.run_mixed import check_node_group

    device = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85e9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    options = RunOptions(backend="nccl", elastic=ElasticSpec(checkpoint_dir="job", rdzv_endpoint="h:1"))
    chosen = check_node_group(options, load_any_cluster(CLUSTER)).elastic
    assert chosen.node_group == H and chosen.replanner == "autopar.mixed.replan:from_worker_args"
    with pytest.raises(AutoparError, match=f"is the GPU of 2 groups \\({H}, {H}#2\\) of --cluster {H}:1,{H}:1; give"):
        check_node_group(options, load_any_cluster(f"{H}:1,{H}:1"))
    device.name = "NVIDIA L4"
    with pytest.raises(AutoparError, match="is the GPU of 0 groups"):
        check_node_group(options, load_any_cluster(CLUSTER))


def test_node_group_with_a_homogeneous_plan_is_one_line(tmp_path, capsys):
    Plan(micro_batch_size=2).save(tmp_path / "plan.json")
    code, _, err = run_cli(capsys, "run", tmp_path / "plan.json", "gpt", "--elastic", "--checkpoint-dir",
                           tmp_path / "job", "--node-group", A)
    assert code == 2 and "is not a mixed plan; leave --node-group out" in err and len(err.strip().splitlines()) == 1


def test_rank_labels_agree_with_the_plans_world_size():
    plan = MixedPlan((Lane((Segment(H, 2, 1), Segment(A, 1, 1)),
                           Plan(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4, precision="fp32",
                                layer_split=(3, 1))),))
    assert plan.world_size == len(rank_labels(plan)) == 3


# -- the real thing ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.procs
def test_killing_one_groups_agent_replans_onto_the_group_left_and_the_losses_are_a_straight_runs(tmp_path):
    result = campaign.shrink_mixed(tmp_path, steps=6, every=2, ports=free_port)
    record = result["replan"]
    assert record["mix_before"] == {A: 1, H: 1} and record["mix_after"] == {result["group_left"]: 1}
    assert record["world_before"] == 2 and record["world_after"] == 1 and "new_plan" in result
    assert result["killed_at_step"] > record["resumed_step"]  # killed mid-interval: steps redone
    assert result["loss_steps"] == list(range(6)) and result["world_size_per_step"][-1] == 1
    assert result["max_abs_loss_diff"] <= 1e-5, result
    assert os.path.isdir(tmp_path / "job" / f"step-{6:08d}")
