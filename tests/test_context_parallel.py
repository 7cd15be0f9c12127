"""Context parallelism (issue 11, point 3): the cp axis's rule, its cost terms against Llama 3's
CP16 row, the plan space and RL masks, the exports, and loss parity of cp2 x dp2 and cp2 x tp2 with
one process on 4 gloo ranks (one torchrun job for the cases, one `autopar run --check-parity`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_exports_degree, free_port, prefix_before, workload
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cli import main
from autopar.cost import PlanArrays, estimate, evaluate
from autopar.cost.context_parallel import kv_exchange
from autopar.envs.parallel_plan_env import ParallelPlanEnv
from autopar.errors import PlanError
from autopar.executor.context_parallel import chunk_positions, shard_sequence
from autopar.executor.parity import max_relative_difference, reference_losses
from autopar.export import export_plan
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.search.published_context_parallel import LLAMA3_CP_TABLE4, context_parallel_rows
from autopar.search.space import enumerate_plans

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "models" / "cp_parity_job.py"


# -- the load-balanced layout ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 16))
def test_each_rank_holds_chunks_i_and_2cp_1_i_and_the_same_causal_work(cp, chunk):
    seq = 2 * cp * chunk
    parts = [chunk_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))  # every token on exactly one rank
    assert all(p[0] == r * chunk and p[-1] == seq - r * chunk - 1 for r, p in enumerate(parts))
    work = {int((p + 1).sum()) for p in parts}  # keys a causal query at position q sees: q + 1
    assert len(work) == 1  # load balanced: every rank the same share of the causal attention


def test_shard_sequence_cuts_inputs_and_targets_alike():
    tokens = torch.arange(2 * 16).reshape(2, 16)
    inputs, targets = shard_sequence((tokens, tokens + 100), 2, 1)
    assert inputs.tolist()[0] == [4, 5, 6, 7, 8, 9, 10, 11] and torch.equal(targets, inputs + 100)
    assert shard_sequence(torch.zeros(4), 2, 0).shape == (4,)  # no sequence dimension: untouched
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 6"):
        chunk_positions(16, 3, 0)


# -- the axis's rule and bad input ------------------------------------------------------------------
def test_cp_needs_attention_and_2cp_dividing_the_sequence():
    w = workload("gpt", size="tiny", global_batch=16)  # seq 32, 8 GPUs
    # valid (it runs and is priced) but not searched: fewer than CP_MIN_TOKENS tokens per rank
    Plan(dp=4, cp=2, micro_batch_size=4).validate(w)
    assert set(enumerate_plans(w).cp.tolist()) == {1}
    assert set(enumerate_plans(workload("llama", size="tiny", seq_len=8192, global_batch=8)).cp.tolist()) == {1, 2, 4}
    with pytest.raises(PlanError, match=r"^cp=4 needs the sequence length 20 divisible by 2 x cp = 8"):
        Plan(dp=1, tp=1, cp=4, micro_batch_size=16).validate(
            workload("gpt", size="tiny", seq_len=20, global_batch=16, gpus_per_node=4))
    with pytest.raises(PlanError, match="has no attention over a sequence to split; use cp=1"):
        Plan(dp=4, cp=2, micro_batch_size=2).validate(workload("resnet", global_batch=8))
    assert set(enumerate_plans(workload("resnet", global_batch=8)).cp.tolist()) == {1}


@pytest.mark.parametrize("args, message", [
    (["gpt", "--model-arg", "size=tiny", "--gpus-per-node", "6", "--dp", "2", "--cp", "3"],
     "cp=3 needs the sequence length 32 divisible by 2 x cp = 6"),
    (["resnet", "--gpus-per-node", "4", "--dp", "2", "--cp", "2"],
     "cp=2 but the model resnet has no attention over a sequence to split; use cp=1"),
])
def test_estimate_refuses_a_bad_cp_in_one_line(args, message, capsys):
    code = main(["estimate", *args, "--cluster", "cpu", "--global-batch", "16", "--micro-batch-size", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


# -- the cost terms -----------------------------------------------------------------------------------
def test_llama3_table4_cp16_row_within_12_percent():
    """Dubey et al. 2024 Table 4: 405B at 131,072 tokens, TP8 CP16 PP16 DP8 on 16,384 H100s, 380 TFLOP/s
    per GPU (runtime megatron, bf16); nothing fitted to it."""
    assert [(r.cp, r.seq_len, r.tp, r.pp, r.dp) for r in LLAMA3_CP_TABLE4] == [(16, 131072, 8, 16, 8)]
    ((label, predicted, published, error),) = context_parallel_rows()
    assert "cp16" in label and published == 380.0
    assert abs(error) <= 0.12, (label, predicted)


def test_cp_splits_a_ranks_tokens_like_dp_and_reduces_gradients_with_it():
    """dp2 (micro-batch 1) and cp2 (micro-batch 2) give each rank the same tokens: the same compute,
    activations and gradient reduction (the group is dp x cp in both), ZeRO shards over dp x cp; cp
    adds only its K/V exchange."""
    w = workload("llama", size="tiny", global_batch=4, gpus_per_node=4)
    dp = Plan(dp=4, micro_batch_size=1, zero=1)
    cp = Plan(dp=2, cp=2, micro_batch_size=2, zero=1)
    a, b = estimate(w, dp), estimate(w, cp)
    for part in ("compute", "recompute", "tp_comm", "dp_comm", "optimizer"):
        assert b.breakdown[part] == pytest.approx(a.breakdown[part], rel=1e-9), part
    for part in ("activations", "optimizer_states", "gradients", "weights"):
        assert b.memory[part] == pytest.approx(a.memory[part], rel=1e-9), part
    assert a.breakdown["cp"] == 0 and b.breakdown["cp"] > 0 and b.memory["cp_memory"] > 0
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s + b.breakdown["cp"], rel=1e-9)


def test_the_cp_term_prices_with_the_estimates_coefficients():
    """A calibrated link efficiency reaches the K/V exchange as it reaches the core terms: halving
    every link's efficiency doubles the exchange, so its exposed part (the exchange less what hides
    under attention) at least doubles for a short-sequence cp plan."""
    from dataclasses import replace

    from autopar.cost.coefficients import Coefficients

    w = workload("llama", cluster="dgx-h100", nodes=2, gpus_per_node=8, size="small", seq_len=256, global_batch=16)
    plan = Plan(dp=1, tp=1, cp=16, micro_batch_size=16, mesh_order=("pp", "dp", "cp", "tp"))
    c = Coefficients.for_cluster(w.cluster, w.runtime)
    slow = replace(c, link_efficiency={k: v / 2 for k, v in c.link_efficiency.items()}, latency_scale=0.0)
    fast = replace(c, latency_scale=0.0)
    a, b = estimate(w, plan, fast), estimate(w, plan, slow)
    assert a.breakdown["cp"] > 0
    assert b.breakdown["cp"] >= 2 * a.breakdown["cp"] * (1 - 1e-9)


def test_the_kv_exchange_hides_under_long_attention_and_not_under_short():
    """Each ring step's K/V rotation hides under that step's attention when the sequence is long
    (attention grows as seq^2, K/V as seq); at a short sequence over the nodes' NICs it is exposed.
    torch's all-gather waits for every rank's K/V after the first (local) step only."""
    long_row = LLAMA3_CP_TABLE4[0]
    from autopar.search.published import llama3_candidates

    w, pa = llama3_candidates(long_row)
    ring = kv_exchange(w, pa, method="alltoall")
    assert np.all(ring["exposed"] == 0) and np.all(ring["traffic"] > 0)
    short = workload("llama", cluster="dgx-h100", nodes=2, gpus_per_node=8, size="small", seq_len=256, global_batch=16)
    plans = PlanArrays.from_plans([Plan(dp=1, tp=1, cp=16, micro_batch_size=16, mesh_order=("pp", "dp", "cp", "tp"))],
                                  short.profile)
    exposed = {m: kv_exchange(short, plans, method=m)["exposed"][0] for m in ("allgather", "alltoall", "p2p")}
    assert all(v > 0 for v in exposed.values()), exposed
    assert evaluate(short, plans)["cp"][0] == exposed["allgather"]  # torch runtime: torch's default rotation


# -- the plan space, the RL environment, the exports ----------------------------------------------------
def test_the_rl_environment_offers_exactly_the_allowed_cp():
    """seq 8196 on 8 GPUs: cp 4 is masked (8196 is not divisible by 2 x 4; 2,049 tokens per rank would
    be offered), cp 8 too (1,024 tokens per rank, under CP_MIN_TOKENS)."""
    w = workload("llama", size="tiny", seq_len=8196, global_batch=16, gpus_per_node=8)
    env = ParallelPlanEnv([w])
    env.reset(seed=0)
    space = env.plan_space
    prefix = prefix_before(space, "cp")
    step = space.step(prefix)
    assert sorted(v for v, ok in zip(step.values, step.allowed) if ok) == [1, 2]
    seen = set()
    for episode in range(12):
        env.reset(seed=episode)
        done = False
        rng = np.random.default_rng(episode)
        while not done:
            _, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        seen.add(info["plan"].cp)
        info["plan"].validate(w)
    assert seen <= {1, 2}


def test_exports_map_cp_or_say_they_cannot():
    plan = Plan(dp=2, tp=2, cp=2, pp=1, micro_batch_size=1, num_micro_batches=4, zero=2)
    assert_exports_degree(plan, "cp=2", "--context-parallel-size", "--parallelism.context_parallel_degree", 2)
    assert "--context-parallel-size" not in export_plan(Plan(dp=8), "megatron").text
    try:
        from megatron.core import ModelParallelConfig
    except ImportError:
        return
    from autopar.export.megatron import MODEL_PARALLEL, core_fields

    fields = core_fields(plan)
    config = ModelParallelConfig(**{k: fields[k] for k in MODEL_PARALLEL if fields[k] is not None})
    assert config.context_parallel_size == 2


# -- the executor: parity with one process, as real torchrun runs ----------------------------------------
def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'models'}", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.procs
def test_cp2_dp2_and_cp2_tp2_match_one_process_on_4_gloo_ranks(tmp_path):
    """GPT (learned positions, written-out attention) and Llama (rotary positions, SDPA, GQA), fp32,
    plain SGD: each cp rank's load-balanced tokens, global positions and all-gathered K/V must give
    the single-process losses to 1e-5 (local positions or a missing K/V gradient would not)."""
    sys.path.insert(0, str(JOB.parent))
    import cp_parity_job as job

    out = tmp_path / "losses.json"
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(free_port()), str(JOB), str(out), "gloo"],
                         env=_env(), capture_output=True, text=True, timeout=400, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == set(job.CASES)
    for name, (model, _) in job.CASES.items():
        mf = load_model_file(model)
        reference = reference_losses(lambda mf=mf, model=model: mf.build(**job.MODEL_ARGS[model]), job.sgd,
                                     mf.loss_fn, [job.batch(model)] * job.STEPS)
        assert max_relative_difference(got[name], reference) <= 1e-5, (name, got[name], reference)


@pytest.mark.slow
@pytest.mark.procs
def test_autopar_run_checks_parity_of_a_cp_plan(tmp_path):
    Plan(dp=2, cp=2, micro_batch_size=4, num_micro_batches=2, precision="fp32").save(tmp_path / "p.json")
    ran = subprocess.run([sys.executable, "-m", "autopar", "run", "p.json", "llama", "--model-arg", "size=tiny",
                          "--nproc-per-node", "4", "--backend", "gloo", "--steps", "2", "--warmup", "1",
                          "--check-parity", "--trace", "t.jsonl"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400, check=False)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    record = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert record["plan"]["cp"] == 2
    assert record["measured"]["parity_ok"] is True and record["measured"]["parity_max_rel_diff"] < 1e-5
