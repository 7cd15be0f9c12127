"""Issue 42, executor: mixed plans on gloo ranks labelled with their group.

In-process: the ranks' labels, samples and loss weights, the weighted-gradient identity, and the
one-line refusals before launch (capability and `autopar run`). Two slow tests, one torchrun job each
(acceptance 3): (b) data-parallel lanes of two groups with shares 3:1 on 2 ranks, and (a) a 3-rank
pipeline over two groups, stage 0 tp2 on ranks 0-1 and stage 1 tp1 on rank 2, blocks 3 + 1; both fp32,
losses within 1e-5 of one process.
"""

from __future__ import annotations

import pytest
import torch

from autopar.capability.mixed import mixed_refusals
from autopar.cli import main
from autopar.errors import PlanError
from autopar.executor.mixed_layout import (
    check_world,
    executed_plan,
    loss_weight,
    rank_labels,
    rank_samples,
    stage_ranks,
    world_size,
)
from autopar.executor.options import RunOptions
from autopar.executor.support import target
from autopar.mixed.plan import Lane, MixedPlan, Segment
from autopar.plan import Plan
from autopar.traces.run_mixed import run_mixed

A100, H100 = "dgx-a100-80g", "dgx-h100"
CLUSTER = f"{A100}:1,{H100}:1"


def lane(group: str, tp: int = 1, **plan) -> Lane:
    return Lane((Segment(group, tp, plan.get("pp", 1)),), Plan(tp=tp, precision="fp32", **plan))


def shares_3_to_1() -> MixedPlan:
    """Acceptance 3 (b): one replica on each group, 6 and 2 samples (3:1), 2 micro-batches each."""
    return MixedPlan((lane(A100, micro_batch_size=3, num_micro_batches=2),
                      lane(H100, micro_batch_size=1, num_micro_batches=2)))


def pipeline_tp2_tp1() -> MixedPlan:
    """Acceptance 3 (a): stage 0 tp2 on the H100s (3 blocks), stage 1 tp1 on an A100 (1 block), 1F1B."""
    return MixedPlan((Lane((Segment(H100, 2, 1), Segment(A100, 1, 1)),
                           Plan(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4, precision="fp32",
                                layer_split=(3, 1))),))


def test_ranks_are_labelled_lane_by_lane_with_their_group():
    labels = rank_labels(MixedPlan((lane(A100, tp=2, dp=2, micro_batch_size=1, num_micro_batches=3),
                                    lane(H100, tp=2, dp=1, micro_batch_size=2, num_micro_batches=1))))
    assert [(l.rank, l.group, l.lane, l.replica, l.tp_rank) for l in labels] == [
        (0, A100, 0, 0, 0), (1, A100, 0, 0, 1), (2, A100, 0, 1, 0), (3, A100, 0, 1, 1),
        (4, H100, 1, 0, 0), (5, H100, 1, 0, 1)]
    spanning = pipeline_tp2_tp1()
    assert world_size(spanning) == 3 and stage_ranks(spanning.lanes[0]) == [[0, 1], [2]]
    assert [str(l) for l in rank_labels(spanning)] == [
        f"rank 0: group {H100}, lane 0, segment 0, stage 0, tp rank 0, replica 0",
        f"rank 1: group {H100}, lane 0, segment 0, stage 0, tp rank 1, replica 0",
        f"rank 2: group {A100}, lane 0, segment 1, stage 1, tp rank 0, replica 0"]


def test_data_parallel_lanes_run_as_one_plan_with_dp_outermost():
    mixed = MixedPlan((lane(A100, tp=2, pp=2, dp=2, micro_batch_size=1, num_micro_batches=4),
                       lane(H100, tp=2, pp=2, dp=1, micro_batch_size=2, num_micro_batches=4)))
    plan = executed_plan(mixed, 1)
    assert (plan.dp, plan.mesh_order[0], plan.micro_batch_size, plan.num_micro_batches) == (3, "dp", 2, 4)
    labels = rank_labels(mixed)
    assert [l.group for l in labels] == [A100] * 8 + [H100] * 4  # each group's ranks contiguous
    assert [l.stage for l in labels[8:]] == [0, 0, 1, 1]


def test_every_sample_is_trained_once_and_weighted_by_the_samples_of_its_rank():
    mixed = MixedPlan((lane(A100, dp=2, micro_batch_size=3, num_micro_batches=1),
                       lane(H100, dp=1, micro_batch_size=2, num_micro_batches=1)))
    labels = rank_labels(mixed)
    samples = [list(rank_samples(mixed, l)) for l in labels]
    assert samples == [[0, 2, 4], [1, 3, 5], [6, 7]]
    assert [loss_weight(mixed, l) for l in labels] == [3 * 3 / 8, 3 * 3 / 8, 3 * 2 / 8]


def test_weighted_losses_averaged_over_replicas_give_the_whole_batch_gradient():
    """What data parallelism does with the weighted losses (the mean of the replicas' gradients) equals
    one process's gradient of the global batch's mean loss; unweighted it would not (shares 3:1)."""
    mixed = shares_3_to_1()
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    model = torch.nn.Linear(5, 1)

    def grad(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = grad(torch.nn.functional.mse_loss(model(x), y))
    labels = rank_labels(mixed)
    replicas = []
    for label in labels:
        index = list(rank_samples(mixed, label))
        replicas.append(grad(torch.nn.functional.mse_loss(model(x[index]), y[index]) * loss_weight(mixed, label)))
    assert torch.allclose(sum(replicas) / len(replicas), whole, atol=1e-6)


@pytest.mark.parametrize("mixed,message", [
    (MixedPlan((lane(A100, micro_batch_size=2), lane(H100, tp=2, micro_batch_size=2))),
     "lanes of different layouts: lane 1 has tp=1, lane 2 tp=2"),
    (MixedPlan((pipeline_tp2_tp1().lanes[0], lane(A100, micro_batch_size=8))),
     "lane 1 spans 2 segments beside 1 other lane(s)"),
    (MixedPlan((Lane(pipeline_tp2_tp1().lanes[0].segments, pipeline_tp2_tp1().lanes[0].plan.with_(dp=2)),)),
     "lane 1 spans segments with dp=2"),
    (MixedPlan((Lane(pipeline_tp2_tp1().lanes[0].segments, pipeline_tp2_tp1().lanes[0].plan.with_(precision="fp16")),)),
     "lane 1 spans segments with precision fp16"),
    (MixedPlan((lane(A100, dp=2, zero=3, micro_batch_size=3, num_micro_batches=2),
                lane(H100, dp=2, zero=3, micro_batch_size=1, num_micro_batches=1))),
     "ZeRO-3 with lanes of 1 and 2 micro-batches"),
])
def test_what_the_executor_cannot_run_is_refused_in_one_line(mixed, message):
    reasons = mixed_refusals(mixed, target("gloo"))
    assert reasons and reasons[0].startswith(message) and "\n" not in reasons[0]


def test_the_acceptance_plans_are_runnable():
    assert mixed_refusals(shares_3_to_1(), target("gloo")) == []
    assert mixed_refusals(pipeline_tp2_tp1(), target("gloo")) == []


def test_autopar_run_refuses_before_launch(tmp_path, capsys):
    """One line, exit 2, and nothing launched (the quick tier fails a test that starts a process)."""
    path = tmp_path / "mixed.json"
    MixedPlan((lane(A100, micro_batch_size=2), lane(H100, tp=2, micro_batch_size=2))).to_json(path)
    run = ["run", str(path), "gpt", "--cluster", CLUSTER]
    cases = [(["--nproc-per-node", "3", "--backend", "gloo"], "autopar: error: lanes of different layouts"),
             (["--nproc-per-node", "2", "--backend", "gloo"], "autopar: error: the mixed plan runs on 3 ranks but "
                                                              "--nnodes 1 x --nproc-per-node 2 = 2"),
             (["--nproc-per-node", "3", "--backend", "gloo", "--cluster", A100],
              "autopar: error: --cluster dgx-a100-80g is one group")]
    for flags, line in cases:
        assert main([*run, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
    assert main(["run", str(path), "gpt", "--nproc-per-node", "3", "--backend", "gloo"]) == 2
    assert "needs its cluster: add --cluster" in capsys.readouterr().err


def _run(tmp_path, mixed: MixedPlan) -> dict:
    path = tmp_path / "mixed.json"
    mixed.to_json(path)
    options = RunOptions(nproc_per_node=world_size(mixed), backend="gloo", steps=2, warmup=1, optimizer="sgd",
                         lr=2.0, check_parity=True, no_dropout=True, timeout_s=300)
    ran = run_mixed(path, "gpt", {"size": "tiny"}, options, cluster=CLUSTER)
    assert ran.launched.outcome == "ok", ran.launched.error
    return ran.launched.result


@pytest.mark.slow
def test_b_data_parallel_lanes_of_two_groups_with_shares_3_to_1_match_one_process(tmp_path):
    result = _run(tmp_path, shares_3_to_1())
    m = result["measured"]
    assert [r["group"] for r in result["ranks"]] == [A100, H100]
    assert m["losses"][-1] < m["losses"][0] - 0.1  # it learns: the comparison is not of flat curves
    assert m["parity_ok"] and m["parity_max_rel_diff"] <= 1e-5, m


@pytest.mark.slow
def test_a_pipeline_over_two_groups_tp2_stage_feeding_a_tp1_stage_matches_one_process(tmp_path):
    result = _run(tmp_path, pipeline_tp2_tp1())
    m = result["measured"]
    assert [(r["group"], r["stage"], r["tp_rank"]) for r in result["ranks"]] == [(H100, 0, 0), (H100, 0, 1),
                                                                                  (A100, 1, 0)]
    assert m["losses"][-1] < m["losses"][0] - 0.1
    assert m["parity_ok"] and m["parity_max_rel_diff"] <= 1e-5, m


def test_a_mixed_plan_of_another_size_is_refused_on_the_ranks_too():
    with pytest.raises(PlanError, match="runs on 3 ranks but the ranks launched = 2"):
        check_world(pipeline_tp2_tp1(), 2, "the ranks launched")
