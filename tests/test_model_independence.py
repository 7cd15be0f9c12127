"""Profiles and predictions follow the architecture, not how a model file writes it.

Three Llamas of one shape (the bundled one: separate q/k/v, K/V repeated before SDPA; HF
transformers' LlamaForCausalLM from a LlamaConfig on the meta device: its attention classes, SDPA
with enable_gqa, a hand-written RMSNorm; tests/models/llama_fused.py: one fused qkv projection,
SDPA with enable_gqa, complex-number rotary) and two GPTs (the bundled one with explicit softmax
attention; tests/models/gpt_sdpa.py with separate q/k/v and SDPA).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost import PlanArrays, evaluate
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.workload import Workload

MODELS = Path(__file__).resolve().parent / "models"
ZOO = Path(__file__).resolve().parent.parent / "autopar" / "zoo"
LLAMAS = (ZOO / "llama.py", MODELS / "hf_llama.py", MODELS / "llama_fused.py")
pytest.importorskip("transformers")

FIVE_PLANS = (
    Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=8, zero=3),
    Plan(dp=1, tp=8, pp=1, micro_batch_size=1, num_micro_batches=64, sequence_parallel=True),
    Plan(dp=2, tp=4, pp=1, micro_batch_size=2, num_micro_batches=16, zero=1, recompute="full", recompute_blocks=32),
    Plan(dp=2, tp=2, pp=2, micro_batch_size=1, num_micro_batches=32, recompute="selective"),
    Plan(dp=1, tp=2, pp=4, micro_batch_size=1, num_micro_batches=64, schedule="interleaved", virtual_stages=2),
)


@pytest.fixture(scope="module")
def llamas():
    return [profile_model(path, {"size": "llama3-8b"}) for path in LLAMAS]


def _rel(a, b):
    return abs(a / b - 1)


def test_three_llamas_profile_alike(llamas):
    """Same parameters, FLOPs within 1%, saved bytes within 5%, flash-style attention (no seq x seq
    tensor) for all three, and the same tensor-parallel bounds from the head counts."""
    bundled = llamas[0]
    for other in llamas[1:]:
        assert other.params == bundled.params
        assert other.num_layers == bundled.num_layers == 32
        assert _rel(other.fwd_flops, bundled.fwd_flops) <= 0.01
        a, b = other.layers[0], bundled.layers[0]
        assert _rel(a.fwd_flops + a.bwd_flops, b.fwd_flops + b.bwd_flops) <= 0.01
        assert _rel(a.attn_flops, b.attn_flops) <= 0.01 and a.attn_scores == b.attn_scores
        assert _rel(a.saved_bytes, b.saved_bytes) <= 0.05
        assert a.attn_core_bytes == 0  # enable_gqa takes the flash path (it took the math path before)
        assert {8, 32} <= set(a.tp_units)
        assert _rel(other.head.saved_bytes, bundled.head.saved_bytes) <= 0.05


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_three_llamas_predict_alike(llamas, runtime):
    """The same predicted iteration time for five plans, within 3%, under Megatron-Core (which runs its
    own kernels whatever the file writes) and under torch (which runs each file's own eager ops: the
    three apply rotary in the activations' dtype; an fp32 rotation would move twice the bytes and is
    priced so, as it runs)."""
    cluster = load_cluster("dgx-a100-80g")
    for plan in FIVE_PLANS:
        # the cost model's figure, whether or not autopar's executor could run the file this way
        # (HF's and the fused file's layouts limit its pipeline and sequence parallelism)
        times = [float(evaluate(Workload(p, cluster, 64, runtime=runtime),
                                PlanArrays.from_plans([plan], p))["iteration_time"][0]) for p in llamas]
        assert max(times) / min(times) - 1 <= 0.03, (plan.describe(), times)


def test_megatron_keeps_one_activation_figure_for_the_three(llamas):
    """Under runtime megatron every dense layer keeps Megatron-Core's tensors, counted from the
    architecture (cost/fused.py), and the ends' loss is Megatron's: the three files' activation
    memory is the same to the byte for the five plans (under torch each keeps its own ops')."""
    cluster = load_cluster("dgx-a100-80g")
    for plan in FIVE_PLANS:
        acts = [float(evaluate(Workload(p, cluster, 64, runtime="megatron", switches=("flash_attn",)),
                               PlanArrays.from_plans([plan], p))["activations"][0]) for p in llamas]
        assert max(acts) == pytest.approx(min(acts), rel=1e-12), (plan.describe(), acts)


def test_gpt_written_two_ways_profiles_alike():
    explicit = profile_model(ZOO / "gpt.py", {"size": "1.7b"})
    sdpa = profile_model(MODELS / "gpt_sdpa.py", {"size": "1.7b"})
    a, b = explicit.layers[0], sdpa.layers[0]
    assert explicit.params == sdpa.params
    assert _rel(a.fwd_flops, b.fwd_flops) <= 0.01 and _rel(a.bwd_flops, b.bwd_flops) <= 0.01
    assert a.attn_flops == b.attn_flops and a.attn_scores == b.attn_scores
    assert a.attn_core_bytes > 0 and b.attn_core_bytes == 0  # explicit softmax keeps its scores; flash does not
    # outside the attention core the two hold the same activations
    assert _rel(a.saved_bytes - a.attn_core_bytes, b.saved_bytes) <= 0.05


def test_fused_attention_backward_counts_model_flops_only():
    """A flash backward recomputes q·kᵀ; the profile counts the four model matmuls of backward (2x
    forward), as for explicit attention, and the cost model prices the recompute as time."""
    layer = profile_model(ZOO / "llama.py", {"size": "tiny"}, cache=False).layers[0]
    explicit = profile_model(ZOO / "gpt.py", {"size": "tiny"}, cache=False).layers[0]
    assert layer.bwd_flops == pytest.approx(2 * layer.fwd_flops)
    assert explicit.bwd_flops == pytest.approx(2 * explicit.fwd_flops)
