"""Each block's host time follows the kernels it launches (cost/launches.py): the profiler counts
every forward op that runs a kernel, per block, and the cost model prices the ends in layers' worth
of those launches, with Megatron's loss counted as it runs under the switch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import workload

from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost import cross_entropy
from autopar.cost.launches import block_weights
from autopar.cost.model import _kind_arrays
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.traces.vtrain import MODEL_FILE, SWITCHES
from autopar.workload import Workload


def test_the_profile_counts_each_blocks_kernels():
    """The zoo GPT's forward, op by op: the embedding's two lookups, position arange, add and dropout;
    a layer's two norms, four linears, q·kᵀ, scale, mask, softmax, two dropouts, probs·v, the heads'
    merge (clone) and two residual adds; the head's norm and matmul, and F.cross_entropy's two
    (log-softmax, nll). Reshapes without a kernel (views, _unsafe_view) launch nothing."""
    p = profile_model(MODEL_FILE, {"hidden": 256, "heads": 4, "layers": 2, "vocab": 1024, "seq_len": 128},
                      dtype="fp16")
    assert [(b.kind, b.launches, b.loss_launches) for b in p.blocks] == [
        ("embed", 5, 0), ("Block", 18, 0), ("head", 4, 2)]
    # per instance, not per sample's size: the count does not grow with the sequence
    longer = profile_model(MODEL_FILE, {"hidden": 256, "heads": 4, "layers": 2, "vocab": 1024, "seq_len": 256},
                           dtype="fp16")
    assert [b.launches for b in longer.blocks] == [b.launches for b in p.blocks]


def _vtrain_workload(switches=SWITCHES) -> Workload:
    p = profile_model(MODEL_FILE, {"hidden": 256, "heads": 4, "layers": 4, "vocab": 1024, "seq_len": 128},
                      dtype="fp16")
    return Workload(p, workload("gpt").cluster, 16, switches=switches)


def test_ends_weigh_their_launches_and_megatrons_loss_its_own():
    w = _vtrain_workload()
    k = _kind_arrays(w.profile)
    # the file's head without its loss (2), plus Megatron's vocabulary-parallel loss
    np.testing.assert_allclose(block_weights(k, w), [5 / 18, 1.0, (2 + cross_entropy.LOSS_LAUNCHES) / 18])
    plain = _vtrain_workload(switches=())
    np.testing.assert_allclose(block_weights(_kind_arrays(plain.profile), plain), [5 / 18, 1.0, 4 / 18])
    # a profile stored before launches were counted prices every block as a layer, as before
    old = dataclasses.replace(w.profile, blocks=tuple(dataclasses.replace(b, launches=0.0, loss_launches=0.0)
                                                      for b in w.profile.blocks))
    stale = Workload(old, w.cluster, 16, switches=SWITCHES)
    np.testing.assert_array_equal(block_weights(_kind_arrays(old), stale), [1.0, 1.0, 1.0])


@pytest.mark.parametrize("pp", [1, 2])
def test_host_time_is_the_launch_weighted_block_count(pp):
    """With host and GPU time added (host_overlap 1), each rank's host time per micro-batch is
    block_host_s x (3 passes x its launch-weighted blocks + its recomputed layers), and the pipeline
    takes every rank's once plus (m - 1) x the slowest's: exact. At pp 2 the first stage holds the
    embedding and 2 layers, the last 2 layers and the head (the slowest, its GPU work too)."""
    w = _vtrain_workload()
    plan = Plan(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=4, recompute="full",
                recompute_blocks=4 // pp, schedule="1f1b" if pp > 1 else "gpipe")
    pa = PlanArrays.from_plans([plan], w.profile)
    host = 1e-3
    base = evaluate(w, pa, Coefficients(host_overlap=1.0, block_host_s=1e-12))
    on = evaluate(w, pa, Coefficients(host_overlap=1.0, block_host_s=host))
    embed, head, layers = 5 / 18, (2 + cross_entropy.LOSS_LAUNCHES) / 18, 4 // pp
    stages = [[embed, head]] if pp == 1 else [[embed], [head]]
    per_mb = [host * (3 * (layers + sum(ends)) + layers) for ends in stages]
    expected = sum(per_mb) + (4 - 1) * per_mb[-1]
    assert on["iteration_time"][0] - base["iteration_time"][0] == pytest.approx(expected, rel=1e-6)
