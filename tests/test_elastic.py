"""Elastic runs: the re-plan decision and batch rule, the growth protocol, the job folder, the
one-process loop (resume, re-plan call, records), bad flags; and ONE real torchrun run: 4 gloo
ranks as two agents with --nnodes 1:2, the agent that does not host the rendezvous store killed
mid-interval, the job re-planned for 2 ranks and compared with the same checkpoint loaded
directly under the 2-rank plan (experiments/elastic_campaign.py runs it and the growth case)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cli import main
from autopar.errors import AutoparError, PlanError
from autopar.executor.elastic import JobDir, train_elastic
from autopar.executor.rendezvous import BACKEND, DeferredGrowth, WorkerSide
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.replan import ReplanDecision, ReplanRecord
from autopar.search.replan import Replanner, batches_near, rescaled

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "autopar" / "zoo" / "gpt.py")
TINY = {"size": "tiny"}
MODEL = load_model_file(GPT)
spec = importlib.util.spec_from_file_location("elastic_campaign", ROOT / "experiments" / "elastic_campaign.py")
campaign = importlib.util.module_from_spec(spec)
spec.loader.exec_module(campaign)


@pytest.fixture(scope="module")
def replanner():
    return Replanner(GPT, TINY, cluster="cpu", gpus_per_node=2)


# -- the planner side ---------------------------------------------------------------------------------
def test_batches_near_tries_the_batch_then_outward_smaller_first():
    assert list(batches_near(6))[:7] == [6, 5, 7, 4, 8, 3, 9]
    assert list(batches_near(1)) == [1, 2]


def test_rescaled_changes_only_dp_and_the_micro_batch_count():
    old = Plan(dp=4, tp=2, micro_batch_size=2, num_micro_batches=1, precision="fp32")
    new = rescaled(old, 4, 8)
    assert (new.dp, new.tp, new.micro_batch_size, new.num_micro_batches) == (2, 2, 2, 2)
    assert new.with_(dp=4, num_micro_batches=1) == old
    assert rescaled(old, 3, 8) is None  # tp2 does not divide 3 ranks
    assert rescaled(old, 4, 6) is None  # dp2 x micro-batch 2 does not divide 6


PLANS = st.builds(lambda dp, mbs, nmb: Plan(dp=dp, micro_batch_size=mbs, num_micro_batches=nmb, precision="fp32"),
                  st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 3]))


@pytest.mark.heavy
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=PLANS, world=st.integers(1, 8), tolerance=st.sampled_from([0.0, 0.05, 0.5]))
def test_a_replan_fits_the_new_world_and_keeps_the_old_plan_only_within_the_tolerance(replanner, old, world,
                                                                                     tolerance):
    from autopar.search import get_planner
    from autopar.workload import Workload

    r = Replanner(GPT, TINY, cluster="cpu", gpus_per_node=2, tolerance=tolerance)
    d = r(old, world)
    assert d.plan.world_size == world
    batch = d.plan.global_batch
    profile = replanner_profile()
    d.plan.validate(Workload(profile=profile, cluster=r.cluster(world), global_batch=batch))
    # the batch rule: the old global batch unless no batch closer to it has a plan
    near = list(batches_near(old.global_batch))
    for b in near[:near.index(batch)]:
        with pytest.raises(AutoparError):
            get_planner("rl").propose(Workload(profile=profile, cluster=r.cluster(world), global_batch=b), 1)
    if d.decision == "kept":
        assert d.plan == rescaled(old, world, batch)
        assert d.predicted_old_s <= d.predicted_new_s * (1 + tolerance)
    else:
        assert d.predicted_old_s is None or d.predicted_old_s > d.predicted_new_s * (1 + tolerance)


def replanner_profile():
    from autopar.profile import profile_model

    return profile_model(GPT, TINY, dtype="fp32")


def test_the_tolerance_decides_between_keeping_and_replanning(replanner):
    old = Plan(dp=4, micro_batch_size=2, num_micro_batches=1, precision="fp32")
    strict = replanner(old, 2)  # the rescaled dp2 plan is predicted slower than the planner's best
    assert strict.decision == "replanned" and strict.predicted_old_s > strict.predicted_new_s * 1.05
    assert "slower" in strict.reason
    lenient = Replanner(GPT, TINY, cluster="cpu", gpus_per_node=2, tolerance=0.9)(old, 2)
    assert lenient.decision == "kept" and lenient.plan == old.with_(dp=2, num_micro_batches=2)
    with pytest.raises(AutoparError, match="tolerance"):
        Replanner(GPT, TINY, tolerance=1.5)


# -- the growth protocol ------------------------------------------------------------------------------
class FakeHandler:
    waiting = 0

    def num_nodes_waiting(self):
        return self.waiting

    def get_run_id(self):
        return "job"

    def use_agent_store(self):
        return False


def test_a_joining_node_is_reported_only_once_the_workers_wait_at_a_boundary():
    store = dist.HashStore()
    inner = FakeHandler()
    handler, workers = DeferredGrowth(inner, store), WorkerSide(store, "job")
    assert handler.num_nodes_waiting() == 0 and not workers.growth_requested()
    inner.waiting = 1
    assert handler.num_nodes_waiting() == 0  # mid-interval: torchrun must not restart the workers
    assert workers.growth_requested()
    workers.at_boundary(8)
    assert handler.num_nodes_waiting() == 1  # now it restarts them, with the node
    workers.clear_growth()  # the new group's rank 0
    inner.waiting = 0
    assert handler.num_nodes_waiting() == 0 and not workers.growth_requested()
    assert handler.get_backend() == BACKEND and handler.get_run_id() == "job"


# -- the job folder and the loop ----------------------------------------------------------------------
def test_a_redone_interval_replaces_the_lost_one_and_a_torn_line_is_skipped(tmp_path):
    job = JobDir(tmp_path)
    plan = Plan(dp=1, micro_batch_size=2, num_micro_batches=1)
    job.commit(2, plan, 4, [1.0, 2.0])
    job.commit(4, plan, 4, [3.0, 4.0])
    with open(tmp_path / "history.jsonl", "a") as f:
        f.write('{"first_step": 4, "loss')  # killed mid-write
    job.commit(4, plan, 2, [3.5, 4.5])  # resumed from step 2 under 2 ranks... then from 4
    assert job.losses() == {0: (1.0, 4), 1: (2.0, 4), 2: (3.5, 2), 3: (4.5, 2)}
    assert job.latest()["world_size"] == 2 and Plan.from_dict(job.latest()["plan"]) == plan


def test_a_replan_record_round_trips_and_refuses_an_unknown_decision():
    fields = {"world_before": 4, "world_after": 2, "old_plan": {}, "new_plan": {}, "decision": "kept",
              "reason": "r", "resumed_step": 8, "steps_lost": 1, "global_batch_before": 8, "global_batch_after": 8,
              "planning_s": 0.5, "checkpoint_load_s": 0.2}
    record = ReplanRecord(**fields)
    assert ReplanRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert "4 -> 2 ranks at step 8: kept" in record.describe()
    with pytest.raises(AutoparError, match="decision"):
        ReplanRecord(**{**fields, "decision": "maybe"})
    with pytest.raises(AutoparError, match="fields"):
        ReplanRecord.from_dict({**fields, "extra": 1})


def _one_rank(tmp_path, steps, replan=None, plan=None):
    """train_elastic in this process (a world of one), on a tiny GPT without dropout."""
    from autopar.executor.parity import without_dropout

    def batch(step, global_batch):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(step)
            return MODEL.example_batch(global_batch, device="cpu", **TINY)

    plan = plan or Plan(dp=1, micro_batch_size=2, num_micro_batches=2, precision="fp32")
    try:
        run = train_elastic(plan, lambda: without_dropout(MODEL.build(**TINY)),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-3), MODEL.loss_fn, batch,
                            checkpoint_dir=tmp_path, steps=steps, checkpoint_every=2, replan=replan, backend="gloo")
        return run.first_step, run.replan, run.plan
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_one_rank_resumes_from_its_last_checkpoint_with_the_losses_of_a_straight_run(tmp_path):
    _one_rank(tmp_path / "straight", 6)
    straight = JobDir(tmp_path / "straight").losses()
    assert _one_rank(tmp_path / "resumed", 4)[0] == 0
    first, record, _ = _one_rank(tmp_path / "resumed", 6)
    resumed = JobDir(tmp_path / "resumed").losses()
    assert first == 4 and record is None and list(resumed) == list(range(6))
    assert max(abs(straight[s][0] - resumed[s][0]) for s in range(6)) <= 1e-5


def test_a_plan_for_another_world_is_replanned_on_rank0_and_recorded(tmp_path):
    two = Plan(dp=2, micro_batch_size=2, num_micro_batches=1, precision="fp32")
    asked = []

    def replan(old, world):
        asked.append((old, world))
        return ReplanDecision(old.with_(dp=1, num_micro_batches=2), "kept", "test", 0.25, 1.0, 1.0)

    first, record, plan = _one_rank(tmp_path, 2, replan, two)
    assert asked == [(two, 1)] and first == 0 and plan.world_size == 1
    assert (record.world_before, record.world_after, record.steps_lost, record.planning_s) == (2, 1, 0, 0.25)
    assert JobDir(tmp_path).replans() == [record]
    with pytest.raises(PlanError, match="no replan function"):
        _one_rank(tmp_path / "other", 2, None, two)

    def failing(old, world):
        raise AutoparError("no plan fits")

    with pytest.raises(PlanError, match="re-planning for 1 ranks failed: AutoparError: no plan fits"):
        _one_rank(tmp_path / "third", 2, failing, two)


# -- bad flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--elastic"], "--elastic needs --checkpoint-dir"),
    (["--checkpoint-dir", "{d}/job"], "--checkpoint-dir needs --elastic"),
    (["--elastic", "--checkpoint-dir", "{d}/job", "--checkpoint-every", "0"], "--checkpoint-every must be"),
    (["--elastic", "--checkpoint-dir", "{d}/job", "--min-nodes", "3"], "--min-nodes <= --nnodes"),
    (["--elastic", "--checkpoint-dir", "{d}/job", "--check-parity"], "--check-parity cannot"),
    (["--elastic", "--checkpoint-dir", "{d}/plan.json"], "is not a folder"),
    (["--elastic", "--checkpoint-dir", "{d}/job", "--replan-tolerance", "2"], "--replan-tolerance"),
    (["--elastic", "--checkpoint-dir", "{d}/job", "--rdzv-endpoint", "nohost"], "HOST:PORT"),
])
def test_bad_elastic_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    Plan(dp=1, micro_batch_size=2, num_micro_batches=1).save(tmp_path / "plan.json")
    before = sorted(os.listdir(tmp_path))
    code = main(["run", str(tmp_path / "plan.json"), GPT, *[f.format(d=tmp_path) for f in flags]])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert sorted(os.listdir(tmp_path)) == before


# -- the real thing: two torchrun agents, one killed --------------------------------------------------
@pytest.mark.slow
@pytest.mark.procs
def test_killing_the_agent_without_the_store_replans_for_2_ranks_and_continues_like_a_direct_resume(tmp_path):
    result = campaign.shrink(tmp_path, steps=12, every=4, ports=free_port)
    assert result["replan"]["world_before"] == 4 and result["replan"]["world_after"] == 2
    assert result["killed_at_step"] > result["replan"]["resumed_step"]  # killed mid-interval
    assert result["replan"]["steps_lost"] >= result["killed_at_step"] - result["replan"]["resumed_step"]
    assert result["max_abs_loss_diff"] <= 1e-5 and len(result["losses_after_resume"]) == 12 - result["replan"][
        "resumed_step"]
    assert result["trace_outcome"] == "ok" and result["trace_plan"] == result["new_plan"]
    assert [tuple(r[:2]) for r in result["trace_replans"]][-1] == (4, 2)
    assert result["world_size_per_step"][-1] == 2


def test_a_job_folder_of_another_model_is_refused_before_anything_starts(tmp_path, capsys):
    Plan(dp=1, micro_batch_size=2, num_micro_batches=1, precision="fp32").save(tmp_path / "plan.json")
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text('{"model": "llama", "digest": "0", "args": {}}')
    code = main(["run", str(tmp_path / "plan.json"), GPT, "--model-arg", "size=tiny", "--backend", "gloo",
                 "--elastic", "--checkpoint-dir", str(job)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "another model" in err[0], err
    assert sorted(os.listdir(job)) == ["job.json"]


def test_the_elastic_torchrun_command_line_is_one_torch_parses():
    from torch.distributed.run import get_args_parser

    from autopar.cli.elastic import REPLANNER
    from autopar.executor.launch import torchrun_argv
    from autopar.executor.options import ElasticSpec, RunOptions
    from autopar.executor.worker import parse_args

    elastic = ElasticSpec(checkpoint_dir="/shared/job", rdzv_endpoint="node0:29400", min_nodes=2,
                          checkpoint_every=5, replanner=REPLANNER, cluster="cpu")
    argv = torchrun_argv("p.json", "gpt", {}, RunOptions(nproc_per_node=2, nnodes=4, elastic=elastic), "r.json")
    args = get_args_parser().parse_args(argv)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.max_restarts) == ("2:4", BACKEND,
                                                                                       "node0:29400", 3)
    assert "last_call_timeout" in args.rdzv_conf and args.module
    worker = parse_args(args.training_script_args)
    assert worker.options.elastic == elastic  # the worker receives the whole spec
    module, _, name = REPLANNER.partition(":")  # what the worker resolves: the planner side's factory
    assert callable(getattr(importlib.import_module(module), name))
