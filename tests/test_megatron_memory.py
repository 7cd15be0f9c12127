"""Under runtime megatron a dense layer keeps for backward what Megatron-Core keeps, whatever the
model file writes (autopar/cost/fused.py `megatron_layer_saved`): Korthikanti et al. 2022's count
for a GPT layer, and Transformer Engine's fp8 copies of the linears' inputs instead of the bf16
ones (autopar/cost/precision.py `te_saved_credit`), with its fp8 weight copies for the layers'
linears only. One figure for every file of a Llama shape: tests/test_model_independence.py."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import ZOO, workload

from autopar.cost import estimate
from autopar.plan import Plan

S, H, HEADS = 32, 64, 4  # the tiny GPT's sequence, hidden size and heads
STATS = 16  # bytes per token: the two LayerNorms' fp32 mean and reciprocal deviation


def _layer(model: str, plan: Plan, cluster="dgx-a100-80g", switches=(), fp8=False, runtime="megatron") -> float:
    """Activation bytes one more layer adds on the (only) pipeline rank, one micro-batch in flight."""
    acts = []
    for layers in (4, 5):
        w = workload(model, cluster, gpus_per_node=8, global_batch=plan.global_batch, size="tiny", layers=layers)
        w = dataclasses.replace(w, runtime=runtime, switches=switches, fp8=fp8)
        acts.append(estimate(w, plan).memory["activations"])
    return acts[1] - acts[0]


def _plan(tp: int, sequence_parallel: bool, recompute="none", precision="bf16", b=2) -> Plan:
    return Plan(dp=8 // tp, tp=tp, pp=1, micro_batch_size=b, num_micro_batches=1, precision=precision,
                fp8_recipe="tensorwise" if precision == "fp8" else "none", recompute=recompute,
                sequence_parallel=sequence_parallel)


def test_the_profile_marks_the_dropout_masks():
    """Two hidden-state dropouts per GPT layer (after the projection and the MLP), one byte per
    element; the Llama file has none."""
    gpt = workload("gpt", size="tiny").profile
    assert [b.mask_saved_bytes for b in gpt.layers] == [2 * S * H]
    assert [b.mask_saved_bytes for b in workload("llama", size="tiny").profile.layers] == [0.0]
    # the bundled GPT is written as Megatron's layer: the file keeps Korthikanti's 34 bytes per hidden
    # element and token outside the core, and the norms' statistics
    layer = gpt.layers[0]
    assert layer.saved_bytes - layer.attn_core_bytes == S * (34 * H + STATS)


def test_only_dropouts_masks_are_masks(tmp_path):
    """A boolean tensor the backward keeps is a dropout's mask only when dropout made it: a causal
    mask the file builds in forward (an s x s bool tensor masked_fill saves) is not one, and does not
    join Megatron's layer."""
    from autopar.profile import profile_model

    source = (ZOO / "gpt.py").read_text()
    built = source.replace("mask = self.mask[:s, :s] if self.mask is not None else None",
                           "mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)")
    assert built != source
    (tmp_path / "gpt_mask.py").write_text(built)
    zoo, mine = (profile_model(path, {"size": "tiny"}, cache=False).layers[0]
                 for path in (ZOO / "gpt.py", tmp_path / "gpt_mask.py"))
    assert mine.saved_bytes == zoo.saved_bytes + S * S  # the file does keep its mask, a byte per score
    assert mine.mask_saved_bytes == zoo.mask_saved_bytes == 2 * S * H


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_gpt_layer_keeps_korthikantis_count(tp):
    """Korthikanti et al. 2022, section 4 (b the micro-batch, a the heads): sbh(10 + 24/t +
    5as/ht) under tensor parallelism alone, sbh(34 + 5as/h)/t with sequence parallelism, 34sbh/t with
    selective recompute on top, plus the norms' statistics; Megatron's unfused attention (no
    flash_attn switch) keeps 5 bytes per score."""
    b = 2
    sbh, core = S * b * H, 5 * HEADS * S * S * b
    assert _layer("gpt", _plan(tp, False)) == pytest.approx(sbh * (10 + 24 / tp) + core / tp + STATS * S * b,
                                                            rel=1e-12)
    if tp > 1:
        sp = _layer("gpt", _plan(tp, True))
        assert sp == pytest.approx((34 * sbh + core + STATS * S * b) / tp, rel=1e-12)
        assert _layer("gpt", _plan(tp, True, "selective")) == pytest.approx((34 * sbh + STATS * S * b) / tp,
                                                                             rel=1e-12)


def test_the_runtimes_differ_only_where_the_file_differs_from_megatrons_layer():
    """A Llama file's eager norms and SwiGLU keep more than Megatron-Core's fused kernels: torch
    prices the file's, megatron its own (the tiny Llama, per layer and token: the file's figure is
    its profile's; Megatron's, with a flash kernel: 4h norms + 16 statistics + 4h entries + 2(h + 2kv)
    q, k, v + 2h attention output + 4 ffn gate and up + 2 ffn activation output)."""
    plan = _plan(1, False)
    h, kv, ffn = 64, 32, 192  # tiny Llama: 4 heads of 16, 2 key/value heads
    megatron = 4 * h + 4 * h + 2 * (h + 2 * kv) + 2 * h + 6 * ffn + STATS
    assert _layer("llama", plan, switches=("flash_attn",)) == pytest.approx(2 * S * megatron, rel=1e-12)
    file = workload("llama", size="tiny").profile.layers[0].saved_bytes
    assert _layer("llama", plan, runtime="torch") == pytest.approx(2 * file, rel=1e-12)
    assert file > S * megatron  # the eager file keeps more


@pytest.mark.parametrize(("switches", "recompute", "proj"), [
    ((), "none", 1),  # unfused attention: the projection's fp8 copy replaces its bf16 input
    (("flash_attn",), "none", -1),  # the flash kernel keeps its bf16 output too: one byte more
    (("flash_attn",), "selective", 1),  # recompute reruns the core, which drops it
])
def test_transformer_engines_fp8_copies(switches, recompute, proj):
    """fp8 under sequence parallelism: TE saves the sequence shard of the norms' outputs in fp8
    (1 byte where bf16 kept 2: a byte per element of the shard, twice), the activation's output in
    fp8 (a byte per ffn element of the rank's share), and the attention's output as `proj` says."""
    tp, b, h, ffn = 2, 2, 64, 192
    bf16 = _layer("llama", _plan(tp, True, recompute), "dgx-h100", switches)
    fp8 = _layer("llama", _plan(tp, True, recompute, "fp8"), "dgx-h100", switches, fp8=True)
    assert bf16 - fp8 == pytest.approx(S * b * (2 * h / tp + ffn / tp + proj * h / tp), rel=1e-12)


def test_fp8_weight_copies_are_the_layers_linears_on_the_rank():
    """One byte per parameter of the rank's layer linears; the embedding and the head stay bf16."""
    w = dataclasses.replace(workload("llama", "dgx-h100", gpus_per_node=8, global_batch=8, size="tiny"),
                            runtime="megatron", fp8=True)
    plan = Plan(dp=2, tp=2, pp=2, micro_batch_size=1, num_micro_batches=4, precision="fp8", fp8_recipe="tensorwise")
    h, kv, ffn, layers = 64, 32, 192, 4
    linears = h * (h + 2 * kv) + h * h + 2 * h * ffn + ffn * h  # q, k, v; o; w1, w3; w2
    extra = estimate(w, plan).memory["weights"] - estimate(w, plan.with_(precision="bf16", fp8_recipe="none")).memory["weights"]
    assert extra == pytest.approx(layers // 2 * linears / 2, rel=1e-12)  # the peak rank's two layers, over tp
