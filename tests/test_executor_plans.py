"""Every plan the search space holds runs with parity, or is refused before launch with its reason
(4 gloo ranks, tiny GPT).

The space of the tiny GPT on 4 CPU ranks, global batch 16, holds ~5,700 plans over precision x
schedule x recompute x ZeRO x tp/sp x micro-batching x mesh order. Running them all would take
hours, so the cases are a pairwise covering set: every pair of knob values that occurs together
in the space occurs together in some case (a fault from one knob or from two interacting shows).
Each case trains 3 steps; its losses must match the single-process reference in the plan's
precision within that precision's stated tolerance (`parity.TOLERANCES`). Plans outside the
space that the executor cannot run are refused by `support.refusal` before any process starts.

One 4-rank job (torch.multiprocessing, gloo pinned so a GPU machine runs it too) runs every collected
case in turn (`-k` picks some), as tests/test_executor_parity.py does.
"""

import itertools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from conftest import collected, free_port, workload

from autopar.errors import PlanError
from autopar.executor.mesh import release_meshes
from autopar.executor.parity import TOLERANCES, max_relative_difference, reference_losses
from autopar.executor.support import refusal
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import PRECISIONS, Plan
from autopar.search.space import enumerate_plans

WORLD, STEPS, GLOBAL_BATCH = 4, 3, 16
# fp8 needs CUDA (refused on gloo: tests/test_fp8_refusal.py), which also runs compiled blocks (the
# compiled plans of the space are left out here: inductor takes about a minute per plan on the CPU)
CPU_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp8")
ARGS = {"size": "tiny", "dropout": 0.0}
GPT = load_model_file("gpt")


def knobs(plan: Plan) -> dict:
    """The values a case must cover, pairwise (bucket size and exact recompute counts excluded:
    tests/test_executor_parity.py covers those)."""
    return {"precision": plan.precision, "degrees": (plan.dp, plan.tp, plan.pp),
            "schedule": (plan.schedule, plan.virtual_stages) if plan.pp > 1 else "-",
            "recompute": plan.recompute, "zero": plan.zero, "sp": plan.sequence_parallel,
            "comm": plan.grad_comm_dtype, "offload": plan.offload_optimizer, "mesh": plan.mesh_order,
            "micro_batches": min(plan.num_micro_batches, MANY_MICRO_BATCHES)}


# Micro-batch counts from 4 up are one class: accumulation over several, a pipeline schedule past its
# fill (pp <= 4 here: at 4 micro-batches every 1F1B rank reaches its steady phase) and interleaving's
# n % pp rule are all met at 4; 8 and 16 add only time (a tensor-parallel case at 16 micro-batches of 1
# takes 15-25 s on gloo, at 4 of 4 about 2 s). The class at 8 made the covering set's cost (`cost`)
# 179 units against 116 at 4, for pairs the 4-class covers.
MANY_MICRO_BATCHES = 4


def pairs(plan: Plan) -> set:
    return set(itertools.combinations(sorted(knobs(plan).items(), key=lambda kv: kv[0]), 2))


def cost(plan: Plan) -> float:
    """A case's relative cost on gloo, for ranking only: every tensor-parallel micro-batch and rank
    pays DTensor's Python dispatch for every op (a third more under selective recompute), the rest
    is about the same for every case (timed case by case on 2 cores: tp 1 about a second, tp 4 x 16
    micro-batches 13 s)."""
    dtensor = plan.num_micro_batches * plan.tp if plan.tp > 1 else 0
    return 1 + dtensor * (1.5 if plan.recompute == "selective" else 1)


def covering_cases(plans: list[Plan], given: list[Plan] = ()) -> list[Plan]:
    """A cheap set of `plans` that, beside the cases `given` (run anyway), covers every pair of knob
    values that `plans` cover. Greedy: repeatedly the plan covering most uncovered pairs per unit of
    `cost` (ties to the earliest, so it is stable); then, most costly first, every chosen plan whose
    pairs the others cover is dropped (greedy keeps some: 36 cases of cost 116 became 25 of 86)."""
    candidates = [(p, pairs(p), cost(p)) for p in plans]
    wanted = set().union(*(c for _, c, _ in candidates))
    done = set().union(set(), *map(pairs, given))
    uncovered = wanted - done
    chosen = []
    while uncovered:
        plan, covered, _ = max(candidates, key=lambda pcw: len(pcw[1] & uncovered) / pcw[2])
        chosen.append(plan)
        uncovered -= covered
    for plan in sorted(chosen, key=cost, reverse=True):
        others = [p for p in chosen if p is not plan]
        if wanted <= done.union(*map(pairs, others)):
            chosen = others
    return chosen


def space() -> list[Plan]:
    out = []
    for precision in CPU_PRECISIONS:
        w = workload("gpt", cluster="cpu", gpus_per_node=WORLD, global_batch=GLOBAL_BATCH, dtype=precision, **ARGS)
        arrays = enumerate_plans(w)
        out += [arrays.plan(i) for i in range(len(arrays)) if not arrays.compile[i]]
    # the zero-bubble schedules run as the named cases below (ZERO_BUBBLE) and in tests/test_zero_bubble.py:
    # their pairs with every other knob made the covering set 18 cases (minutes) larger
    return [p for p in out if p.schedule not in ("zb", "zbv", "dualpipev")]


SPACE = space()
BASE = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 4, "num_micro_batches": 4}
# the crashes first found by hand, kept by name (each failed before its fix)
CRASHES = {
    "fp16 tp2 pp2 (no DDP: scaler got mixed Tensor and DTensor gradients)":
        Plan(**{**BASE, "tp": 2, "pp": 2}, precision="fp16"),
    "bf16 pp2 dp2 selective recompute (autocast live in backward: CheckpointError)":
        Plan(**{**BASE, "dp": 2, "pp": 2, "micro_batch_size": 2}, precision="bf16", recompute="selective"),
    "fp16 pp2 tp2 sp selective recompute (CheckpointError)":
        Plan(**{**BASE, "tp": 2, "pp": 2}, precision="fp16", recompute="selective", sequence_parallel=True),
    "interleaved zero3 pp2 dp2 (rank view copied an FSDP2 module)":
        Plan(**{**BASE, "dp": 2, "pp": 2, "micro_batch_size": 2}, precision="fp32", schedule="interleaved",
             virtual_stages=2, zero=3),
}
# outside the gloo space (offload is pointless when the host is the device) but still runnable
OFFLOAD = {f"{p} zero3 offload dp2 pp2": Plan(**{**BASE, "dp": 2, "pp": 2, "micro_batch_size": 2}, precision=p,
                                              zero=3, offload_optimizer=True) for p in CPU_PRECISIONS}
# per-stage recompute with an end-only stage (issue 41): each stage's own setting, a stage of no block
STAGES = {
    "1f1b pp4, embedding-only and head-only stages, per-stage recompute":
        Plan(**{**BASE, "pp": 4}, precision="fp32", layer_split=(0, 2, 2, 0),
             stage_recompute=("none", "full:1", "selective", "none")),
    "interleaved pp2 v2 dp2 zero1, embedding-only and head-only stages, per-stage recompute":
        Plan(**{**BASE, "dp": 2, "pp": 2, "micro_batch_size": 2}, precision="fp32", schedule="interleaved",
             virtual_stages=2, zero=1, layer_split=(0, 3, 1, 0),
             stage_recompute=("none", "full:2", "selective", "none")),
    "1f1b tp2 pp2 sequence parallel, embedding-only first stage, per-stage recompute":
        Plan(**{**BASE, "tp": 2, "pp": 2, "num_micro_batches": 2, "micro_batch_size": 8}, precision="fp32",
             sequence_parallel=True, layer_split=(0, 4), stage_recompute=("none", "selective")),
}
# HSDP 2 x 2 (issue 41): FSDP2 on the 2-D (replicate, shard) mesh; ZeRO-1's optimizer over the shard group
HSDP = {f"hsdp 2x2 zero{z} fp32": Plan(**{**BASE, "dp": 4, "micro_batch_size": 1}, precision="fp32", dp_replicate=2,
                                       zero=z) for z in (1, 2, 3)}
HSDP["hsdp dp2 cp2 zero2 fp32 (cp in the shard group)"] = Plan(**{**BASE, "dp": 2, "micro_batch_size": 2}, cp=2,
                                                                precision="fp32", dp_replicate=2, zero=2)
# zero-bubble (issue 41): torch's ScheduleZBVZeroBubble on stages placed in a V (rank 0 holds the embedding's
# and the head's stage, the tied weights' two copies), ZeRO-2, per-stage full recompute, an embedding-only stage
ZERO_BUBBLE = {
    "zbv pp2 dp2 zero2, embedding-only first stage, per-stage full recompute":
        Plan(**{**BASE, "dp": 2, "pp": 2, "micro_batch_size": 2}, precision="fp32", schedule="zbv", virtual_stages=2,
             zero=2, layer_split=(0, 2, 1, 1), stage_recompute=("none", "full:2", "none", "full:1")),
}
NAMED = {**CRASHES, **OFFLOAD, **STAGES, **HSDP, **ZERO_BUBBLE}
CASES = {**NAMED, **{f"{p.describe()} {p.precision}": p for p in covering_cases(SPACE, list(NAMED.values()))}}


def sgd(params):
    return torch.optim.SGD(params, lr=2.0)  # plain SGD: wrong gradient scaling shows in the losses


def _worker(rank: int, port: int, out: str, names: list) -> None:
    """Run the named cases; each rank appends its results as JSON lines. A failing case ends the job at
    once (its peers may wait on it in a collective): the cases after it are reported as not run."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(1000)
    batch = GPT.example_batch(GLOBAL_BATCH, device="cpu", **ARGS)
    with open(f"{out}.rank{rank}", "a") as f:
        for name in names:
            plan = CASES[name]
            try:
                par = apply(plan, lambda: GPT.build(**ARGS), sgd, GPT.loss_fn, tp_plan=GPT.tp_plan,
                            blocks=GPT.blocks, backend="gloo", timeout_s=60)
                local = par.local_batch(*batch)
                result = {"losses": par.global_losses([par.train_step(*local) for _ in range(STEPS)])}
            except Exception as e:  # noqa: BLE001 - recorded; the test names it
                f.write(json.dumps({"case": name, "error": f"rank {rank}: {type(e).__name__}: {e}"[:500]}) + "\n")
                f.flush()
                os._exit(1)  # mp.spawn then ends the peers
            f.write(json.dumps({"case": name, **result}) + "\n")
            f.flush()
    release_meshes()  # the plans' models and meshes: destroying the groups then joins their threads
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def losses(request, tmp_path_factory):
    """{case: losses, or the error of the first rank that failed it} of the collected cases; cases never run
    are absent."""
    out = str(tmp_path_factory.mktemp("plans") / "losses")
    names = collected(request, "test_every_plan_runs_with_parity_in_its_precision", "name")
    try:
        mp.spawn(_worker, args=(free_port(), out, names), nprocs=WORLD)
    except ProcessException:
        pass  # the failed case's error is in the rank files
    results = {}
    for rank in range(WORLD):
        path = f"{out}.rank{rank}"
        lines = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        for line in lines:
            if "error" in line or line["case"] not in results:
                results[line["case"]] = line.get("error", line.get("losses"))
    return results


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(1000)
    batch = GPT.example_batch(GLOBAL_BATCH, device="cpu", **ARGS)
    return {p: reference_losses(lambda: GPT.build(**ARGS), sgd, GPT.loss_fn, [batch] * STEPS, precision=p)
            for p in CPU_PRECISIONS}


def test_the_cases_cover_every_pair_of_knob_values_in_the_space():
    assert set().union(*map(pairs, CASES.values())) >= set().union(*map(pairs, SPACE))
    assert len(CASES) < 80  # the suite's budget: about a second a case on 2 cores


def test_the_space_holds_nothing_the_executor_refuses():
    assert [p for p in SPACE if refusal(p, "gloo")] == []


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
@pytest.mark.procs
def test_every_plan_runs_with_parity_in_its_precision(losses, reference, name):
    plan, got = CASES[name], losses.get(name, "not run: an earlier case failed and ended the job")
    assert not isinstance(got, str), got
    expected = reference[plan.precision]
    assert max_relative_difference(got, expected) <= TOLERANCES[plan.precision], (got, expected)


REFUSED = [(Plan(**{**BASE, "dp": 4, "micro_batch_size": 1}, precision="bf16", grad_comm_dtype="bf16"), "gloo",
            "needs NCCL")]


@pytest.mark.parametrize("plan,backend,reason", REFUSED)
def test_plans_outside_the_space_are_refused_before_anything_starts(plan, backend, reason):
    assert reason in refusal(plan, backend)
    with pytest.raises(PlanError, match=reason):
        apply(plan, lambda: GPT.build(**ARGS), sgd, GPT.loss_fn, backend=backend)
    assert not dist.is_initialized()
