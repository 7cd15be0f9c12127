"""HSDP (issue 41): dp = replicate x shard, the folded axis dp_replicate.

The plan rules and the space's offer (shard groups of whole nodes), its pricing (ZeRO's states
sharded by the shard group only, the collectives' sizes and links: reduce-scatter and all-gather
within the shard group, the gradient shards all-reduced across the replicas), HSDP winning where
slow inter-node links carry ZeRO's traffic, the capability rules, the CLI flag and the exports.
The executor's fp32 parity for HSDP 2 x 2 runs in tests/test_executor_plans.py's one job."""

import dataclasses
import shlex

import numpy as np
import pytest
from conftest import workload

from autopar import axes, cost
from autopar.capability import Target, refusal
from autopar.cli import main
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import all_gather_time, all_reduce_time
from autopar.errors import PlanError
from autopar.export import export_plan
from autopar.knobs import knob
from autopar.plan import Plan
from autopar.search.space import enumerate_plans

NODE = 8  # GPUs per node of the presets below


@pytest.fixture(scope="module")
def slow_links():
    """Eight PCIe nodes (no NVLink: a node's ring runs at the UPI's 20.8 GB/s, the NICs' at 25 GB/s per
    GPU): ZeRO-2 over all 64 GPUs pays its 64-rank rings' steps on every bucket, HSDP 8-rank ones."""
    return workload("gpt", cluster="l40s-pcie", nodes=8, global_batch=256, size="1.7b")


@pytest.fixture(scope="module")
def space(slow_links):
    return enumerate_plans(slow_links)


def price(w, plans, coeffs=None):
    return cost.evaluate(w, cost.PlanArrays.from_plans(plans, w.profile), coeffs)


def test_plan_rules_are_one_line_errors():
    assert Plan(dp=8, dp_replicate=2, zero=1).dp_replicate == 2
    assert Plan(dp=6, dp_replicate=3, zero=3).dp_replicate == 3  # any divisor may be named
    with pytest.raises(PlanError, match=r"dp_replicate=2 \(HSDP\) .* needs zero 1, 2 or 3"):
        Plan(dp=8, dp_replicate=2)
    with pytest.raises(PlanError, match="dp_replicate=3 must divide dp = 8"):
        Plan(dp=8, dp_replicate=3, zero=2)
    assert Plan.from_dict(Plan(dp=8, zero=2).to_dict() | {"dp_replicate": 4}).dp_replicate == 4


def test_the_space_offers_a_shard_group_of_one_node_and_no_zero0_with_replicas(slow_links, space):
    choices = knob("dp_replicate").choices
    # dp 64 x tp 1: a shard group of one node's 8 ranks, and 1 replica (all of dp)
    assert choices(slow_links, {"dp": 64, "tp": 1, "cp": 1, "ep": 1}) == [1, 8]
    # tp 2: a node holds 4 dp ranks: 16 replicas of 4
    assert choices(slow_links, {"dp": 64, "tp": 2, "cp": 1, "ep": 1}) == [1, 16]
    # tp 8 fills a node: a shard group of one rank is not offered
    assert choices(slow_links, {"dp": 8, "tp": 8, "cp": 1, "ep": 1}) == [1]
    pa = space
    assert len(np.unique(pa.dp_replicate)) > 1
    shard_span = pa.dp // pa.dp_replicate * pa.tp
    assert np.all((pa.dp_replicate == 1) | (shard_span == slow_links.cluster.gpus_per_node))
    assert not np.any((pa.dp_replicate > 1) & (pa.zero == 0))
    assert np.all(pa.dp % pa.dp_replicate == 0)


def test_states_are_sharded_by_the_shard_group_exactly(slow_links):
    base = Plan(dp=64, micro_batch_size=4, num_micro_batches=1)
    for zero in (1, 2, 3):
        plans = [base.with_(zero=zero, dp_replicate=r) for r in (1, 2, 8)]
        out = price(slow_links, plans)
        states = out["optimizer_states"]
        local = states[0] * 64 / 8  # Adam's two fp32 moments: 8 bytes a parameter, over 64 ranks
        for i, r in enumerate((1, 2, 8)):
            shard = 64 // r
            assert states[i] == pytest.approx(local * 8 / shard, rel=1e-12)
            assert out["master_weights"][i] == pytest.approx(local * 4 / shard, rel=1e-12)
            gradients = local * 2 / (shard if zero >= 2 else 1)  # bf16 gradients, sharded from ZeRO-2
            assert out["gradients"][i] == pytest.approx(gradients, rel=1e-12)
        if zero == 3:  # weights sharded by the shard group (and the two gathered blocks, the same for all)
            assert out["weights"][1] - out["weights"][0] == pytest.approx(local * 2 * (1 / 32 - 1 / 64), rel=1e-9)


def test_the_collectives_run_over_the_shard_group_and_across_the_replicas(slow_links):
    """Nothing hidden (dp_overlap 0), one micro-batch: ZeRO-2's exposed time is the reduce-scatter within
    the shard group, the all-reduce of the gradient shards across the replicas and one all-gather."""
    w = slow_links
    cluster = w.cluster
    c = dataclasses.replace(Coefficients.for_cluster(cluster, w.runtime), dp_overlap=0.0)
    base = c.collective_latency_s
    plans = [Plan(dp=64, micro_batch_size=4, num_micro_batches=1, zero=2, dp_replicate=r) for r in (1, 8)]
    out = price(w, plans, c)
    local = out["optimizer_states"][0] * 64 / 8
    grads, params = local * 4, local * 2  # gradients reduced in fp32 (the default), bf16 weights

    def link(size, stride):
        ring = cluster.ring(size, stride)
        return ring.bandwidth * c.link(ring.kind), ring.latency * c.latency_scale

    def zero2(shard, shard_link, reduce_s):
        bw, lat = shard_link
        return (all_gather_time(grads, shard, bw * c.collective("reduce_scatter"), lat, base) + reduce_s
                + all_gather_time(params, shard, bw * c.collective("all_gather"), lat, base))

    flat = zero2(64, link(64, 1), 0.0)
    node = link(8, 1)  # a replica's shard group: one node's 8 GPUs
    across = link(8, 8)  # the 8 replicas: one GPU per node, 8 apart
    hsdp = zero2(8, node, all_reduce_time(grads / 8, 8, *across, base))
    assert out["dp_comm"] == pytest.approx([flat, hsdp], rel=1e-9)
    assert cluster.ring(8, 1).kind != "ib" and cluster.ring(8, 8).kind == "ib"  # a node's links, the NICs
    assert hsdp < flat


def test_hsdp_wins_the_search_where_zero_over_all_ranks_is_slower(slow_links, space):
    pa = space
    out = cost.evaluate(slow_links, pa)
    time = np.where(out["fits"], out["iteration_time"], np.inf)
    best = int(np.argmin(time))
    flat = np.min(np.where(pa.dp_replicate == 1, time, np.inf))
    assert pa.dp_replicate[best] > 1 and time[best] < 0.995 * flat, pa.plan(best).describe()
    # the same plan sharded over all 64 ranks instead is slower
    plan = pa.plan(best)
    again = price(slow_links, [plan, plan.with_(dp_replicate=1)])
    assert again["iteration_time"][0] < again["iteration_time"][1]


def test_plans_without_replicas_are_priced_as_before(slow_links):
    """dp_replicate 1 takes the gradient group's size and links: the same numbers as a plan that never
    named it (the uniform plans' fingerprint is checked over the old field list in the report)."""
    plan = Plan(dp=64, micro_batch_size=4, num_micro_batches=1, zero=3)
    out = price(slow_links, [plan, Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "dp_replicate"})])
    assert out["iteration_time"][0] == out["iteration_time"][1]


def test_what_the_executor_cannot_lay_out_is_refused_in_one_line():
    torch_target = Target()
    why = refusal("dp_replicate", torch_target, 2, {"ep": 2})
    assert why.startswith("dp_replicate=2 with ep=2: the executor does not combine HSDP") and "\n" not in why
    assert refusal("dp_replicate", Target(runtime="megatron"), 2, {"ep": 2}) is None
    order = ("pp", "cp", "tp", "dp")  # dp innermost: cp outside dp
    assert "needs dp outside cp" in refusal("mesh_order", torch_target, order, {"cp": 2, "dp_replicate": 2})
    assert refusal("mesh_order", torch_target, order, {"cp": 1, "dp_replicate": 2}) is None
    assert refusal("mesh_order", torch_target, axes.default_order(), {"cp": 2, "dp_replicate": 2}) is None


def test_cli_flag_and_a_bad_degree(capsys):
    args = ["estimate", "gpt", "--model-arg", "size=1.7b", "--cluster", "l40s-pcie", "--nodes", "8",
            "--global-batch", "256", "--dp", "64", "--micro-batch-size", "4"]
    assert main(args + ["--zero", "2", "--dp-replicate", "8"]) == 0
    assert "replicated data" in capsys.readouterr().out
    assert main(args + ["--dp-replicate", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs zero 1, 2 or 3" in err[0]


def test_exports():
    hsdp = Plan(dp=16, micro_batch_size=1, num_micro_batches=2, dp_replicate=4, zero=3)
    titan = shlex.split(export_plan(hsdp, "torchtitan").text)
    assert titan[titan.index("--parallelism.data_parallel_replicate_degree") + 1] == "4"
    assert titan[titan.index("--parallelism.data_parallel_shard_degree") + 1] == "4"
    assert '"mics_shard_size": 4' in export_plan(hsdp, "deepspeed").text
    assert "dp_replicate=4 with zero=3" in export_plan(hsdp, "megatron").unexpressed_line()
    assert "dp_replicate=4" in export_plan(hsdp, "accelerate").unexpressed_line()
    zero1 = hsdp.with_(zero=1)
    megatron = shlex.split(export_plan(zero1, "megatron").text)
    assert megatron[megatron.index("--num-distributed-optimizer-instances") + 1] == "4"
    assert "dp_replicate" not in export_plan(zero1, "megatron").unexpressed_line()
    assert "mics_shard_size" not in export_plan(zero1, "deepspeed").text
    assert "dp_replicate=4 with zero=1" in export_plan(zero1, "deepspeed").unexpressed_line()
    assert "num-distributed-optimizer-instances" not in export_plan(hsdp.with_(dp_replicate=1), "megatron").text


def test_megatron_core_reads_the_partial_distributed_optimizer():
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig

    from autopar.export.megatron import DDP, core_fields

    fields = core_fields(Plan(dp=16, micro_batch_size=1, num_micro_batches=2, dp_replicate=4, zero=1))
    ddp = DistributedDataParallelConfig(**{k: v for k, v in fields.items() if k in DDP and v is not None})
    assert ddp.use_distributed_optimizer and ddp.num_distributed_optimizer_instances == 4
