"""The presets of published runs' machines (docs/hardware.md): Grand Teton H100, the 750 W B200."""

from __future__ import annotations

import pytest

from autopar.cluster import GPUS, load_cluster, preset_names
from autopar.cluster.gpus import GIB
from autopar.cost.coefficients import gpu_calibration


def test_grand_teton_h100_lies_between_the_nvl_and_sxm_datasheets_at_500_w():
    c = load_cluster("grand-teton-h100", nodes=2)
    gpu = c.gpu
    assert gpu == GPUS["h100-gt"] and c.gpus_per_node == 8 and "grand-teton-h100" in preset_names()
    # H100 NVL (400 W) 835 / 1,670 TFLOP/s, H100 SXM (700 W) 989 / 1,979: a third of the way at 500 W
    assert gpu.peak_flops["bf16"] == pytest.approx(835e12 + (989e12 - 835e12) / 3)
    assert gpu.peak_flops["fp8"] == pytest.approx(1670e12 + (1979e12 - 1670e12) / 3)
    assert gpu.hbm_bytes_per_s == 2.4e12 and gpu.memory_bytes == pytest.approx(95.08 * GIB)  # torchtitan's 2.4 TB/s
    assert c.links["ib"].bandwidth == 50e9  # 400 Gb/s RDMA per GPU
    cal = gpu_calibration(gpu.name)
    assert cal.derived_from == "A100" and cal.gemm_ceiling == pytest.approx(792.1 / 989)


def test_b200_750w_between_the_b100_and_b200_datasheets():
    gpu = load_cluster("dgx-b200-750w").gpu
    assert gpu.peak_flops["bf16"] == pytest.approx(1750e12 + 500e12 / 6)
    assert gpu.peak_flops["mxfp8"] == gpu.peak_flops["fp8"] == pytest.approx(3500e12 + 1000e12 / 6)
    assert gpu.hbm_bytes_per_s == GPUS["b200"].hbm_bytes_per_s and gpu.memory_bytes == GPUS["b200"].memory_bytes
    assert gpu_calibration(gpu.name).calibrated


def test_h200_memory_as_torch_reports_it_and_the_held_out_set_unchanged():
    from autopar.envs.workloads import HELDOUT_CLUSTERS

    assert GPUS["h200"].memory_bytes == pytest.approx(139.80 * GIB)
    assert HELDOUT_CLUSTERS == ("dgx-h200", "gb200-nvl72", "l40s-pcie")  # published-run presets stay out
