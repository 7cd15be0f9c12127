"""The torch runtime fitted to torch-native rows (issue 40 point 2): its coefficients counted and bounded,
held-out figures on folds cheap enough to run here (experiments/fit_torch_runtime.py prints every row's),
the shipped values as the script fits them, and the two torch switches it added (async_tp, op_sac)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.calibrate import torch_runtime as fit
from autopar.cost import Coefficients, estimate, op_sac, torch_runtime
from autopar.cost import precision as fp8
from autopar.cost.arrays import PlanArrays
from autopar.cost.coefficients import gpu_calibration
from autopar.errors import AutoparError
from autopar.search import published_torch as pt
from autopar.workload import Workload


def test_at_most_four_bounded_coefficients_per_gpu_type():
    assert torch_runtime.TORCH_RUNTIME, "the torch runtime ships no fit"
    for gpu, values in torch_runtime.TORCH_RUNTIME.items():
        assert len(values) <= torch_runtime.MAX_FITTED
        for name, value in values.items():
            lo, hi = fit.bounds(gpu, name)
            assert lo <= value <= hi, (gpu, name, value)
        assert values["gemm_efficiency"] <= gpu_calibration(gpu).gemm_ceiling  # below the measured MAMF
    with pytest.raises(ValueError, match="at most 4"):
        torch_runtime.check(dict.fromkeys(("gemm_efficiency", "compile_elementwise", "fp8_gemm_speedup",
                                           "fp8_rowwise_speedup", "async_tp_overlap"), 1.0))
    with pytest.raises(ValueError, match="outside"):
        torch_runtime.check({"fp8_gemm_speedup": 2.5})


def test_the_torch_fit_applies_under_runtime_torch_only():
    cluster = pt.torch_workload(pt.ROWS[0]).cluster
    shipped = torch_runtime.fitted(cluster.gpu.name)["gemm_efficiency"]
    assert Coefficients.for_cluster(cluster, "torch").gemm_efficiency == shipped
    assert Coefficients.for_cluster(cluster, "megatron").gemm_efficiency != shipped


def _b200():
    return fit.by_gpu()["B200-750W"]


def test_shipped_values_are_the_fit_on_all_rows():
    rows = _b200()  # three rows: the one GPU type whose whole fit runs in a second
    assert fit.fit(rows) == pytest.approx(torch_runtime.fitted("B200-750W"), rel=2e-3)


def test_mxfp8_rows_held_out_one_at_a_time_meet_acceptance_1():
    """torchao's B200 table is its GPU type's only one: each row under the fit of the other two."""
    errors = []
    for case in _b200():
        assert fit.fold(case, _b200()) == "row"
        values = fit.fit([c for c in _b200() if c is not case])
        errors.append(abs(fit.predict(case, values) / case.row.tokens_per_s_per_gpu - 1))
    assert np.median(errors) <= 0.08 and max(errors) <= 0.15, errors


def test_torchtitan_table_1_held_out_meets_acceptance_1():
    """Table 1's rows (eager, compiled, float8) under the fit of every other Grand Teton table."""
    rows = fit.by_gpu()["H100-SXM-96GB-HBM2e-500W"]
    t1 = [c for c in rows if c.row.source == "TT2412:T1"]
    assert len(t1) == 3 and all(fit.fold(c, rows) == "table" for c in t1)
    values = fit.fit([c for c in rows if c.row.source != "TT2412:T1"])
    errors = [abs(fit.predict(c, values) / c.row.tokens_per_s_per_gpu - 1) for c in t1]
    assert max(errors) <= 0.08, errors


def _tp_workload(switches=()):
    row = next(r for r in pt.ROWS if r.source == "TTATP" and r.model == "Llama3-8B" and r.precision == "bf16")
    w = pt.torch_workload(row)
    return dataclasses.replace(w, switches=switches), pt.torch_plan(row, w)


def test_async_tp_changes_only_plans_it_overlaps():
    base, plan = _tp_workload(("op_sac",))
    on, _ = _tp_workload(("op_sac", "async_tp"))
    off = estimate(base, plan.with_(compile=False))
    faster = estimate(on, plan.with_(compile=False))
    assert faster.breakdown["tp_comm"] < 0.9 * off.breakdown["tp_comm"]  # under the fitted share of the GEMMs
    assert faster.iteration_time_s < off.iteration_time_s
    # async TP micro-pipelines sequence parallelism's gathers and scatters only; nothing else moves
    other = plan.with_(compile=False, sequence_parallel=False)
    assert estimate(on, other).iteration_time_s == estimate(base, other).iteration_time_s
    fsdp = pt.torch_workload(pt.ROWS[0])  # torchtitan Table 1: FSDP over 8 GPUs, no tp
    fsdp_plan = pt.torch_plan(pt.ROWS[0], fsdp)
    assert (estimate(dataclasses.replace(fsdp, switches=("async_tp", "op_sac")), fsdp_plan).iteration_time_s
            == estimate(fsdp, fsdp_plan).iteration_time_s)
    with pytest.raises(AutoparError, match="need runtime 'torch'"):
        Workload(base.profile, base.cluster, base.global_batch, runtime="megatron", switches=("async_tp",))


def test_op_sac_recomputes_every_second_matmul_of_a_llama_layer():
    profile = pt.torch_workload(pt.ROWS[0]).profile  # Llama 3 8B: wq, wk, wv, wo, w1, w3, w2
    h, kv, ffn, s = 4096, 1024, 14336, profile.seq_len
    assert op_sac.recomputed_flops(profile)[1] == 2 * s * (kv * h + h * h + ffn * h)  # wk, wo, w3
    w, plan = _tp_workload()
    sac, _ = _tp_workload(("op_sac",))
    plan = plan.with_(compile=False)
    assert estimate(sac, plan).breakdown["recompute"] > estimate(w, plan).breakdown["recompute"]
    full = plan.with_(recompute="full", recompute_blocks=32)
    assert estimate(sac, full).iteration_time_s == estimate(w, full).iteration_time_s


def test_torchtitan_tensorwise_rows_under_tp_run_its_float8_tp_plan():
    """torchtitan applies torchao's float8 TP styles whenever float8 is tensorwise and tp > 1 (its
    `enable_float8_tensorwise_tp`): those rows, and no other, carry the float8_tp switch."""
    with_switch = {r.line for r in pt.ROWS if "float8_tp" in pt.switches(r)}
    assert with_switch == {r.line for r in pt.ROWS if r.tp > 1 and r.precision == "float8-tensorwise"}
    assert with_switch == {8, 9, 10, 11, 14, 15, 20, 21}
    with pytest.raises(AutoparError, match="need runtime 'torch'"):
        Workload(pt.torch_workload(pt.ROWS[0]).profile, pt.torch_workload(pt.ROWS[0]).cluster, 16,
                 runtime="megatron", switches=("float8_tp",))


def test_op_sac_reruns_the_gathers_share_of_the_forward_collectives():
    """Under sequence parallelism op SAC reruns the forward's all-gathers, not its reduce-scatters: half
    of the pass's collective time, a third where float8_tp gathers fp8 (0.75 of the bytes, 0.25 of them
    the gather's)."""
    row = next(r for r in pt.ROWS if r.source == "TTATP" and r.model == "Llama3-8B" and r.precision == "float8-tensorwise")
    w = pt.torch_workload(row)
    assert {"op_sac", "float8_tp"} <= set(w.switches)
    plan = pt.torch_plan(row, w)
    pa = PlanArrays.from_plans([plan, plan.with_(sequence_parallel=False)], w.profile)
    k = len(w.profile.blocks)
    rerun = lambda work: op_sac.recompute_time(work, pa, np.ones((2, 1)), np.full((2, 1), 8.0), np.inf,  # noqa: E731
                                               np.ones((2, k)), np.ones((2, k)), np.zeros((2, k)), np.ones((2, k)),
                                               fp8.tp_forward_scale(work, pa))
    np.testing.assert_allclose(rerun(w), [[1 / 3] * k, [1.0] * k])
    bf16_gathers = dataclasses.replace(w, switches=("op_sac",))
    np.testing.assert_allclose(rerun(bf16_gathers), [[0.5] * k, [1.0] * k])
