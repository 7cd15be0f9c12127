"""Issue 14, point 6: expert parallelism on 4 gloo ranks matches one process within 1e-5 (fp32) for ep2 within dp4, ep4 within dp4
and ep2 within dp2 x pp2 (DDP), and ep2 within dp4 under FSDP2 (experts sharded over their
expert-data-parallel pair of ranks), with routing that is not balanced (a router bias sends most tokens to
the first experts), so the all-to-alls run with uneven splits. Plain SGD at a large learning
rate: a wrong gradient scale of the experts shows in the losses (AdamW would hide it). The first case
runs through `autopar run --check-parity` (torchrun); the others, the same 4 processes' work, in one
4-rank job (torch.multiprocessing) that trains them in turn as the run's workers do."""

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import collected, free_port

from autopar.executor.mesh import release_meshes
from autopar.executor.parity import deterministic, max_relative_difference, reference_losses
from autopar.executor.train_step import apply
from autopar.executor.weights import build_full_model
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.traces.record import read_records

ROOT = Path(__file__).resolve().parent.parent
ARGS = {"size": "tiny", "router_skew": 0.05}
GLOBAL_BATCH = 16
SEED = 0  # autopar run's default --seed


def _plan(dp, ep, pp=1, n=1, zero=0) -> Plan:
    return Plan(dp=dp, pp=pp, ep=ep, micro_batch_size=GLOBAL_BATCH // (dp * n), num_micro_batches=n,
                precision="fp32", zero=zero)


CASES = {"ep2 within dp4": _plan(4, 2), "ep4 within dp4": _plan(4, 4), "ep2 within dp2 x pp2": _plan(2, 2, pp=2, n=2),
         "ep2 within dp4, FSDP2": _plan(4, 2, n=2, zero=3),
         "ep2 within dp4, expert biases and the balanced gate": _plan(4, 2)}
# the published rows' model options (GPT-OSS's expert biases, AutoModel's benchmark gate), balanced routing
CASE_ARGS = {"ep2 within dp4, expert biases and the balanced gate": {"size": "tiny", "expert_bias": True,
                                                                     "gate": "balanced"}}


def _counts() -> list[list[int]]:
    """Tokens per expert of every MoE layer in the first forward of the runs (same seed, same batch)."""
    mf = load_model_file("moe")
    model = build_full_model(partial(mf.build, **ARGS), SEED)
    torch.manual_seed(SEED)
    inputs, _ = mf.example_batch(GLOBAL_BATCH, device="cpu", **ARGS)
    with torch.no_grad():
        model(*inputs)
    return [m.last_counts for m in model.modules() if hasattr(m, "last_counts")]


def test_the_routing_of_the_parity_runs_is_uneven():
    counts = _counts()
    experts = len(counts[0])
    assert len(counts) == 3 and all(sum(c) == GLOBAL_BATCH * 32 * 2 for c in counts)  # dropless: tokens x top-2
    for c in counts:
        assert max(c) >= 2 * sum(c) / experts, c  # the busiest expert takes twice its balanced share or more
        for ep in (2, 4):  # so the per-rank splits of the all-to-all are uneven too
            per_rank = [sum(c[r * experts // ep:(r + 1) * experts // ep]) for r in range(ep)]
            assert max(per_rank) >= 1.5 * min(per_rank), per_rank


CLI_CASE = "ep2 within dp4"  # through `autopar run`; the other cases in the job below


def _case(case):
    """The model file, its build and its batch (seeded as `autopar run` seeds them)."""
    mf, args = load_model_file("moe"), CASE_ARGS.get(case, ARGS)
    torch.manual_seed(SEED)
    return mf, partial(mf.build, **args), mf.example_batch(GLOBAL_BATCH, device="cpu", **args)


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)  # `autopar run --optimizer sgd --lr 1.0`


def _worker(rank: int, port: int, out: str, cases: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    deterministic()  # as `--check-parity` runs
    results = {}
    for case in cases:
        mf, build, batch = _case(case)
        par = apply(CASES[case], build, _sgd, mf.loss_fn, tp_plan=mf.tp_plan if mf.has_tp_plan else None,
                    blocks=mf.blocks, seed=SEED, backend="gloo")
        local = par.local_batch(*batch)
        results[case] = par.global_losses([par.train_step(*local) for _ in range(3)])
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    release_meshes()  # the plans' models and meshes: destroying the groups then joins their threads
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(request, tmp_path_factory):
    """{case: global losses} of the collected cases other than CLI_CASE, from one 4-rank job."""
    cases = [c for c in collected(request, "test_expert_parallel_matches_one_process", "case") if c != CLI_CASE]
    if not cases:
        return {}
    out = tmp_path_factory.mktemp("ep") / "losses.json"
    mp.spawn(_worker, args=(free_port(), str(out), cases), nprocs=4)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
@pytest.mark.procs
def test_expert_parallel_matches_one_process(case, job, tmp_path):
    plan = CASES[case]
    if case != CLI_CASE:
        mf, build, batch = _case(case)
        reference = reference_losses(build, _sgd, mf.loss_fn, [batch] * 3, seed=SEED)
        assert max_relative_difference(job[case], reference) <= 1e-5, (job[case], reference)
        assert job[case][-1] < job[case][0]  # it trains
        return
    plan.save(tmp_path / "p.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    flags = [f for k, v in CASE_ARGS.get(case, ARGS).items() for f in ("--model-arg", f"{k}={v}")]
    ran = subprocess.run([sys.executable, "-m", "autopar", "run", "p.json", "moe", *flags, "--nproc-per-node", "4",
                          "--backend", "gloo", "--steps", "3", "--warmup", "0", "--optimizer", "sgd", "--lr", "1.0",
                          "--check-parity", "--cluster", "cpu", "--trace", "t.jsonl"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    records, problems = read_records(tmp_path / "t.jsonl")
    assert problems == [] and len(records) == 1
    measured = records[0].measured
    assert Plan.from_dict(records[0].plan).ep == plan.ep
    assert measured["parity_ok"] is True and measured["parity_max_rel_diff"] <= 1e-5, json.dumps(measured)
    assert len(measured["losses"]) == 3 and measured["losses"][-1] < measured["losses"][0]  # it trains
