"""Tile and wave quantisation of GEMMs (autopar/cost/gemm.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost.gemm import kind_efficiency, layer_gemms, shape_efficiency
from autopar.profile import profile_model

A100_SMS = 108


def test_whole_waves_of_whole_tiles_lose_nothing():
    # 128 x 256 tiles: M = 128 * 108, N = 256 fills exactly one wave; all three passes too
    assert shape_efficiency([(128 * 108, 256 * 108, 256 * 108, False)], np.array([1]), np.array([1]), A100_SMS)[0] \
        == 1.0


def test_one_tile_past_a_wave_costs_a_wave():
    """109 tiles on 108 SMs take two waves: about half the launched tile-slots are useful."""
    full = shape_efficiency([(128 * 108, 256, 256 * 108, True)], np.array([1]), np.array([1]), A100_SMS)[0]
    past = shape_efficiency([(128 * 109, 256, 256 * 108, True)], np.array([1]), np.array([1]), A100_SMS)[0]
    assert past < 0.8 * full


def test_a_ragged_dimension_pays_for_its_last_tile():
    ragged = shape_efficiency([(2048, 9600 + 1, 25600, True)], np.array([8]), np.array([1]), A100_SMS)[0]
    even = shape_efficiency([(2048, 9600, 25600, True)], np.array([8]), np.array([1]), A100_SMS)[0]
    assert ragged < even


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.sampled_from([1, 2, 4, 8]), st.integers(1, 64), st.integers(1, 64),
       st.integers(1, 64), st.sampled_from([80, 108, 132, 148]))
def test_shape_efficiency_is_a_fraction(b, t, m, n, k, sms):
    e = shape_efficiency([(64 * m, 128 * n, 128 * k, True), (64 * m, 128 * k, 128 * n, False)],
                         np.array([b]), np.array([t]), sms)[0]
    assert 0 < e <= 1


def test_unknown_shapes_and_gpus_without_sms_are_not_quantised():
    assert shape_efficiency(None, np.array([1, 4]), np.array([1, 8]), A100_SMS).tolist() == [1.0, 1.0]
    gpt = profile_model("gpt", {"size": "tiny"})
    assert kind_efficiency(gpt, np.array([1]), np.array([1]), 0).tolist() == [[1.0] * len(gpt.blocks)]


def test_layer_gemms_follow_the_architecture():
    """A gated MLP (Llama) has one gate+up GEMM of twice the ffn width; GQA narrows the qkv GEMM."""
    llama = profile_model("llama", {"size": "llama3-8b"})
    shapes = layer_gemms(llama.dims, llama.seq_len, llama.layers[0])
    h, ffn = llama.dims["hidden"], llama.dims["ffn"]
    assert [s[1] for s in shapes] == [h + 2 * 8 * 128, h, 2 * ffn, h]
    assert sum(2 * m * n * k for m, n, k, _ in shapes) == llama.layers[0].fwd_flops - llama.layers[0].attn_flops
    gpt = profile_model("gpt", {"size": "1.7b"})
    shapes = layer_gemms(gpt.dims, gpt.seq_len, gpt.layers[0])
    assert sum(2 * m * n * k for m, n, k, _ in shapes) == gpt.layers[0].fwd_flops - gpt.layers[0].attn_flops


def test_an_moe_layer_has_the_attentions_gemms_whatever_ffn_a_config_names():
    """Routed experts run grouped GEMMs priced by cost/moe.py: a layer with experts has the attention's
    two GEMMs, and a config that also names a dense `ffn` (Mixtral's intermediate_size is its
    experts') neither adds a made-up dense MLP nor drops the attention's shapes."""
    import dataclasses

    moe = profile_model("moe", {"size": "tiny"})
    dense, routed = moe.layers
    assert not dense.experts and routed.experts
    h, heads, kv = moe.dims["hidden"], moe.dims["heads"], moe.dims["kv_heads"]
    attention = [(moe.seq_len, h + 2 * kv * (h // heads), h, True), (moe.seq_len, h, h, False)]
    named = dataclasses.replace(moe, dims={**moe.dims, "ffn": 4 * h})
    assert layer_gemms(moe.dims, moe.seq_len, routed) == layer_gemms(named.dims, moe.seq_len, routed) == attention
    b, t = np.array([1, 4]), np.array([1, 2])
    assert np.array_equal(kind_efficiency(moe, b, t, A100_SMS)[:, 2], kind_efficiency(named, b, t, A100_SMS)[:, 2])
    # the dense layers an MoE starts with (DeepSeek-V3's first three) have their MLP, at the zoo's dense_ffn
    shapes = layer_gemms(moe.dims, moe.seq_len, dense)
    assert shapes[2:] == [(moe.seq_len, 2 * 128, h, True), (moe.seq_len, h, 128, False)]
    assert sum(2 * m * n * k for m, n, k, _ in shapes) == dense.fwd_flops - dense.attn_flops


@pytest.mark.parametrize("head_dim", [8, 32])
def test_a_head_dim_the_config_names_shapes_the_attentions_gemms(head_dim):
    """q, k, v and the output projection at heads x head_dim where that is not the hidden size (Qwen3,
    GPT-OSS, DeepSeek-V3): the GEMMs' FLOPs are the profiled layer's non-attention FLOPs. At 32 the
    head size equals the tiny model's sequence: the fused kernel's output is still not a score matrix."""
    moe = profile_model("moe", {"size": "tiny", "head_dim": head_dim})
    dense = moe.layers[0]
    assert moe.dims["head_dim"] == head_dim and dense.attn_core_flops == 0
    shapes = layer_gemms(moe.dims, moe.seq_len, dense)
    assert shapes[:2] == [(moe.seq_len, (4 + 2 * 2) * head_dim, 64, True), (moe.seq_len, 64, 4 * head_dim, False)]
    assert sum(2 * m * n * k for m, n, k, _ in shapes) == dense.fwd_flops - dense.attn_flops


def test_a_small_gemms_fixed_latency_is_not_scaled_by_its_idle_tiles():
    """`gemm_half_flops` prices a GEMM's fixed latency (time = (flops + half) / rate) and the tile waves its
    idle SMs: a one-tile GEMM leaves 131 of an H100's 132 SMs idle, which costs its FLOPs, not its latency
    131 times over. A 4-layer GPT of hidden 64 on one H100 stays latency-bound at milliseconds a step (it was
    priced at 10.7 s with micro-batches of 1 when the shape scaled the latency too)."""
    from autopar.cluster import load_cluster
    from autopar.cost import estimate
    from autopar.plan import Plan
    from autopar.workload import Workload

    w = Workload(profile_model("gpt", {"size": "tiny"}, dtype="bf16"), load_cluster("dgx-h100", nodes=1,
                                                                                       gpus_per_node=1), 8)
    steps = {mb: estimate(w, Plan(dp=1, tp=1, pp=1, micro_batch_size=mb, num_micro_batches=8 // mb)).iteration_time_s
             for mb in (1, 8)}
    assert steps[1] < 0.05 and steps[8] < steps[1] < 10 * steps[8], steps
