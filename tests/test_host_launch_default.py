"""Host time without calibration (issue 40 point 4): every GPU generation with a public launch-cost
measurement prices each kernel a layer launches (`Coefficients.launch_s`, `cost/launches.py`), a
calibrated host time replaces that default, and Megatron-Core's dense H100 rows keep their held-out
figures (acceptance 3, experiments/fit_megatron_dense.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import workload

from autopar.cluster import load_cluster
from autopar.cost import Coefficients, estimate
from autopar.cost import coefficients as coefficients_module
from autopar.cost.launches import MEGATRON_LAYER_LAUNCHES, layer_launches
from autopar.cost.model import _kind_arrays
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset, generation", [("dgx-a100-80g", "ampere"), ("dgx-h100", "hopper"),
                                                ("dgx-b200", "blackwell")])
def test_each_generation_prices_its_measured_launch_cost_uncalibrated(preset, generation):
    cluster = load_cluster(preset)
    assert not cluster.coefficients.keys() & coefficients_module.HOST_COEFFICIENTS  # an uncalibrated preset
    for runtime in ("torch", "megatron"):
        c = Coefficients.for_cluster(cluster, runtime)
        assert c.launch_s == coefficients_module.LAUNCH_S[generation] > 0 and c.host


def test_unmeasured_devices_and_calibrated_host_time_take_no_default():
    assert Coefficients.for_cluster(load_cluster("cpu")).launch_s == 0.0
    calibrated = dataclasses.replace(load_cluster("dgx-h100"), coefficients={"block_host_s": 2e-4})
    c = Coefficients.for_cluster(calibrated, "torch")
    assert c.launch_s == 0.0 and c.block_host_s == 2e-4  # the calibration's host time, not added to
    own = dataclasses.replace(load_cluster("dgx-h100"), coefficients={"launch_s": 3e-6})
    assert Coefficients.for_cluster(own, "torch").launch_s == 3e-6


def test_a_layer_launches_the_profiles_kernels_under_torch_and_megatrons_under_megatron():
    w = workload("llama", cluster="dgx-h100", size="llama3-8b")
    k = _kind_arrays(w.profile)
    assert layer_launches(k, w) == w.profile.layers[0].launches > MEGATRON_LAYER_LAUNCHES  # eager RMSNorm, rotary
    meg = dataclasses.replace(w, runtime="megatron")
    assert layer_launches(k, meg) == MEGATRON_LAYER_LAUNCHES


def _small(size="gpt2-small", **args):
    return workload("gpt", cluster="dgx-h100", gpus_per_node=1, global_batch=4, size=size, **args)


def _overhead(w, c=None, share=False) -> float:
    est = estimate(w, Plan(dp=1, micro_batch_size=4, num_micro_batches=1), c)
    return est.breakdown["overhead"] / (est.iteration_time_s if share else 1.0)


def test_the_default_prices_each_launch_of_each_pass_and_shows_where_layers_are_small():
    """With host and GPU time added (host_overlap 1), the host time of one micro-batch is launch_s x a
    layer's launches x (3 passes x the launch-weighted blocks): GPT-2 small's 18 kernels a layer at
    9.4 us on DGX H100 (NVIDIA/Fuser#3507). Under the shipped overlap (a 4-norm) the GPU hides most of
    it; its share of the iteration is ten times larger for a small model than for a 6.7B one."""
    w = _small(seq_len=256)
    c = dataclasses.replace(Coefficients.for_cluster(w.cluster, "torch"), host_overlap=1.0)
    blocks = sum(b.count * b.launches for b in w.profile.blocks) / w.profile.layers[0].launches
    assert _overhead(w, c) == pytest.approx(c.launch_s * 18 * 3 * blocks, rel=1e-6)
    assert _overhead(w, dataclasses.replace(c, launch_s=0.0)) == 0.0
    small, large = _overhead(w, share=True), _overhead(_small("gpt3-6.7b", seq_len=256), share=True)
    assert small > 10 * large > 0


def _fit_script():
    spec = importlib.util.spec_from_file_location("fit_megatron_dense", ROOT / "experiments" / "fit_megatron_dense.py")
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def test_megatron_dense_h100_rows_held_out_by_family():
    """Acceptance 3 as it stands: NeMo 24.07 and Megatron-Bridge 25.11's dense rows, each under the fp8
    speedup fitted without its family. Median and slope meet the issue's 6% and 2 points per decade;
    the max does not (Bridge's Llama 3 8B, -17.4%: 25.11's software runs it 20% faster than NeMo
    24.07's, which no other family's rows can teach), so it is held at today's figure."""
    f = _fit_script().figures()
    assert len(f["errors"]) == 15
    assert f["median"] <= 0.06
    assert abs(f["slope"]) <= 2.0
    assert f["max"] <= 0.18
