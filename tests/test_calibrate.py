"""Calibration: metrics, folds, the least-squares fit, collectives, the CLI, and the vTrain figures."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
from conftest import VTRAIN, workload

from autopar.calibrate import metrics
from autopar.calibrate.collectives import (
    AllReduceTable,
    fit_allreduce,
    log_size_weights,
    predict_allreduce,
    read_allreduce_table,
)
from autopar.calibrate.dataset import build_dataset
from autopar.calibrate.fit import default_parameters, fit, get_value, with_values
from autopar.calibrate.folds import group_holdout, group_kfold
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost.coefficients import FITTED_BOUNDS, gpu_calibration
from autopar.cost.model import TIME_PARTS
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.traces.record import TraceRecord
from autopar.traces.vtrain import write_records

# host time large enough to show in the smallest runs (with 3e-4 per layer's launches it hides under the
# GPU's, and the fit cannot tell it from 1e-5)
TRUE = Coefficients(gemm_half_flops=4e10, elementwise_traffic=0.5, block_host_s=6e-4, host_overlap=6.0,
                    step_overhead_s=2e-3)


# -- metrics and folds --------------------------------------------------------------------------------
def test_metrics():
    measured = np.array([1.0, 2.0, 4.0, 8.0])
    predicted = np.array([1.1, 1.8, 4.0, 9.0])
    assert metrics.mape(predicted, measured) == pytest.approx((0.1 + 0.1 + 0 + 0.125) / 4)
    assert metrics.max_error(predicted, measured) == pytest.approx(0.125)
    assert metrics.spearman(predicted, measured) == pytest.approx(1.0)
    assert metrics.worst(predicted, measured, 2) == [3, 0]
    picks = metrics.group_picks([2.0, 1.0, 5.0, 6.0], [1.0, 1.5, 3.0, 2.0], ["a", "a", "b", "b"])
    assert [(p["group"], p["pick"], p["best"], p["ratio"]) for p in picks] == [("a", 1, 0, 1.5), ("b", 2, 3, 1.5)]


def test_group_folds_keep_every_group_on_one_side():
    keys = [f"m{i % 8}" for i in range(80)]
    folds = group_kfold(keys, 5, seed=3)
    tests = np.concatenate([test for _, test in folds])
    assert sorted(tests.tolist()) == list(range(80))  # each row tested exactly once
    for train, test in folds:
        assert not {keys[i] for i in train} & {keys[i] for i in test}
    assert [t.tolist() for _, t in group_kfold(keys, 5, seed=3)] == [t.tolist() for _, t in folds]
    train, test = group_holdout(keys, 0.2, seed=1)
    assert len(test) >= 16 and not {keys[i] for i in train} & {keys[i] for i in test}
    with pytest.raises(AutoparError, match="cannot make 9 folds from 8 group"):
        group_kfold(keys, 9)


# -- cost-model terms for small runs ----------------------------------------------------------------
def test_small_run_terms_default_off_and_add_up():
    w = workload("gpt", size="gpt2-small", nodes=1, gpus_per_node=8, global_batch=32)
    plans = [Plan(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=8, recompute="full", recompute_blocks=6),
             Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=4)]
    pa = PlanArrays.from_plans(plans, w.profile)
    base = evaluate(w, pa, Coefficients())
    off = evaluate(w, pa, Coefficients(block_host_s=0.0, collective_latency_s=0.0, host_overlap=2.0))
    np.testing.assert_array_equal(base["iteration_time"], off["iteration_time"])
    on = evaluate(w, pa, Coefficients(block_host_s=5e-3, collective_latency_s=1e-4))
    assert (on["iteration_time"] > base["iteration_time"]).all()
    assert (on["overhead"] > 0).all() and on["tp_comm"][0] > base["tp_comm"][0]
    np.testing.assert_allclose(sum(on[p] for p in TIME_PARTS), on["iteration_time"], rtol=1e-9)
    # host work the GPU cannot hide: the p-norm lies between the larger part and the sum
    p1 = evaluate(w, pa, Coefficients(block_host_s=5e-3, host_overlap=1.0))["iteration_time"]
    p32 = evaluate(w, pa, Coefficients(block_host_s=5e-3, host_overlap=32.0))["iteration_time"]
    assert (p1 > on["iteration_time"]).all() and (on["iteration_time"] > p32).all()


def test_host_terms_of_tensor_parallelism_and_selective_recompute_are_exact():
    """On a CPU (host time adds to compute), DTensor's dispatch under TP and the selective
    checkpoint's replay cost their coefficient per layer's launches per pass / per block per
    micro-batch."""
    w = workload("gpt", size="gpt2-small", nodes=1, gpus_per_node=2, global_batch=8)  # 12 layers
    plans = [Plan(dp=1, tp=2, pp=1, micro_batch_size=2, num_micro_batches=4),
             Plan(dp=2, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2, recompute="selective")]
    pa = PlanArrays.from_plans(plans, w.profile)
    base = evaluate(w, pa, Coefficients(host_overlap=1.0, block_host_s=1e-7))["iteration_time"]
    tp = evaluate(w, pa, Coefficients(host_overlap=1.0, block_host_s=1e-7, tp_host_s=1e-3))["iteration_time"]
    sel = evaluate(w, pa, Coefficients(host_overlap=1.0, block_host_s=1e-7, selective_host_s=1e-3))["iteration_time"]
    # 12 layers, and the embedding and head in layers' worth of their kernel launches (cost/launches.py)
    embed, layer, head = (b.launches for b in (w.profile.embed, w.profile.layers[0], w.profile.head))
    assert 0 < embed < layer and 0 < head < layer  # the zoo GPT's: a lookup; a norm, a matmul and F.cross_entropy
    blocks = 12 + (embed + head) / layer
    assert tp - base == pytest.approx([4 * 3 * blocks * 1e-3, 0.0], abs=1e-9)  # 3 passes x 4 micro-batches
    assert sel - base == pytest.approx([0.0, 2 * 12 * 1e-3], abs=1e-9)  # 12 layers x 2 micro-batches


# -- the fit ------------------------------------------------------------------------------------------
def _synthetic_records(coeffs: Coefficients, noise: float = 0.0, seed: int = 0) -> list[TraceRecord]:
    """Runs of two small GPTs on 4 and 8 A100s, timed by the cost model with `coeffs`."""
    rng = np.random.default_rng(seed)
    records = []
    for hidden, layers in ((256, 4), (512, 8)):
        args = {"hidden": hidden, "heads": 8, "layers": layers, "vocab": 1024, "seq_len": 256}
        for gpus in (4, 8):
            w = workload("gpt", nodes=1, gpus_per_node=gpus, global_batch=32, dtype="fp16", **args)
            plans = []
            for tp in (1, 2, 4):
                for pp in (1, 2):
                    dp = gpus // (tp * pp)
                    if dp < 1 or gpus % (tp * pp):
                        continue
                    for mbs in (1, 2, 4, 8):
                        nmb = 32 // (dp * mbs)
                        if nmb >= 1 and nmb * dp * mbs == 32 and (pp == 1 or nmb >= pp):
                            plans.append(Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb,
                                              precision="fp16", recompute="full", recompute_blocks=layers // pp))
            res = evaluate(w, PlanArrays.from_plans(plans, w.profile), coeffs)
            for plan, t in zip(plans, res["iteration_time"]):
                t = float(t * np.exp(noise * rng.standard_normal()))
                records.append(TraceRecord(
                    cluster={"name": "dgx-a100-80g", "nodes": 1, "gpus_per_node": gpus, "gpu": "A100",
                             "backend": "nccl"},
                    model={"name": "gpt", "path": "gpt", "args": args, "dims": dict(args), "params": w.profile.params},
                    workload={"global_batch": 32, "seq_len": 256}, plan=plan.to_dict(), outcome="ok",
                    measured={"median_step_s": t}))
    return records


def test_fit_recovers_known_coefficients():
    ds = build_dataset(_synthetic_records(TRUE), "dgx-a100-80g")
    assert len(ds) > 40 and len(ds.groups) == 4
    names = ["gemm_half_flops", "elementwise_traffic", "block_host_s", "host_overlap", "step_overhead_s"]
    result = fit(ds, Coefficients(), names)
    assert metrics.mape(ds.predict(result.coefficients), ds.measured) < 1e-3
    for name in names:
        assert get_value(result.coefficients, name) == pytest.approx(get_value(TRUE, name), rel=0.05), name


@pytest.mark.heavy
def test_fit_is_robust_and_bounded():
    records = _synthetic_records(TRUE, noise=0.02, seed=1)
    for r in records[:3]:  # three stragglers, 3x slower
        r.measured["median_step_s"] *= 3
    ds = build_dataset(records, "dgx-a100-80g")
    result = fit(ds, Coefficients())
    pred = ds.predict(result.coefficients)
    clean = np.arange(len(ds)) >= 3
    assert metrics.mape(pred[clean], ds.measured[clean]) < 0.03  # the outliers do not drag the rest
    c = result.coefficients
    assert 0 < c.link("nvlink") <= 1 and 0 <= c.dp_overlap <= 1 and c.block_host_s >= 0
    assert "gemm_efficiency" not in result.names  # no block near the ceiling: not identifiable
    assert "link_efficiency.nvlink" in default_parameters(ds)


# -- collectives ----------------------------------------------------------------------------------------
def test_allreduce_fit_recovers_link_coefficients():
    cluster = load_cluster("dgx-a100-80g")
    true = Coefficients(link_efficiency={"nvlink": 0.7}, latency_scale=2.0, collective_latency_s=3e-5)
    ranks = np.repeat([2, 4, 8], 12)
    nbytes = np.tile(2.0 ** np.arange(12, 36, 2), 3)
    seconds = predict_allreduce(cluster, true, ranks, nbytes)
    fitted = fit_allreduce([AllReduceTable("synthetic", ranks, nbytes, seconds)], cluster)
    assert fitted.kind == "nvlink" and fitted.mape < 1e-3
    assert fitted.efficiency == pytest.approx(0.7, rel=0.01)
    assert fitted.collective_latency_s == pytest.approx(3e-5, rel=0.05)


def test_allreduce_fit_on_vtrain_tables():
    tables = [read_allreduce_table(VTRAIN / f"a100_allreduce_{n}gpu.csv") for n in (2, 4, 8)]
    assert [int(t.ranks[0]) for t in tables] == [2, 4, 8] and all(len(t.seconds) == 1024 for t in tables)
    cluster = load_cluster("dgx-a100-80g")
    fitted = fit_allreduce(tables, cluster)
    assert fitted.mape < 0.08
    assert 0.6 < fitted.efficiency <= 1.0  # docs/references.md §3: large messages reach ~78% of 300 GB/s
    # the sizes a tensor-parallel all-reduce moves (1-64 MB: 61 of each table's 1,024 rows, sampled every
    # MiB) fit as well as the rest: 12.5 / 18.2 / 22.0% at worst on 2 / 4 / 8 GPUs (60.5 / 44.9 / 19.0%
    # fitted unweighted, with the per-hop latency driven to its lower bound)
    c = with_values(Coefficients.from_dict(cluster.coefficients),
                    ["link_efficiency.nvlink", "latency_scale", "collective_latency_s"],
                    [fitted.efficiency, fitted.latency_scale, fitted.collective_latency_s])
    for t in tables:
        small = t.nbytes <= 64 * 2**20
        err = predict_allreduce(cluster.with_nodes(1, 8), c, t.ranks[small], t.nbytes[small]) / t.seconds[small] - 1
        assert np.abs(err).max() < 0.25, (int(t.ranks[0]), np.abs(err).max())
    assert fitted.latency_scale > 0.01


def test_log_size_weights_count_each_decade_alike():
    """A table sampled at even byte steps in one decade of message size (901 rows) and evenly in log
    size in the next (49 rows) gives both decades the same total weight; each rank count's weights sum
    to its row count."""
    dense, sparse = np.linspace(1e6, 1e7, 901), np.geomspace(1e7, 1e8, 50)[1:]
    nbytes = np.concatenate([dense, sparse, np.geomspace(1e3, 1e9, 7)])
    ranks = np.array([8] * (len(dense) + len(sparse)) + [2] * 7)
    w = log_size_weights(ranks, nbytes)
    eight = ranks == 8
    assert w[eight].sum() == pytest.approx(eight.sum()) and w[~eight].sum() == pytest.approx(7)
    low, high = w[eight & (nbytes < 1e7)].sum(), w[eight & (nbytes > 1e7)].sum()
    assert low == pytest.approx(high, rel=0.03), (low, high)  # the row at 10 MB aside (1% of the span)
    assert np.allclose(w[~eight][1:-1], w[~eight][1])  # evenly spaced in log size: alike but the two ends
    assert log_size_weights(np.array([4, 4]), np.array([5e6, 5e6])).tolist() == [1.0, 1.0]


# -- CLI and bad input ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "synthetic.jsonl"
    write_records(path, _synthetic_records(TRUE, noise=0.01, seed=2))
    return path


@pytest.mark.slow
def test_cli_calibrate_writes_a_cluster_every_flag_accepts(trace_file, tmp_path, capsys):
    out = tmp_path / "fitted.json"
    assert main(["calibrate", str(trace_file), "--cluster", "dgx-a100-80g", "--holdout", "0.3",
                 "--evaluate", str(trace_file), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["validation"].startswith("hold-out") and report["mape"] < 0.05 and report["spearman"] > 0.95
    ev = report["evaluate"][str(trace_file)]
    assert {"mape", "spearman", "groups", "max_error", "worst"} <= set(ev) and ev["mape"] < 0.05
    assert all(g["ratio"] >= 1.0 for g in ev["groups"])
    cluster = load_cluster(str(out))
    assert cluster.coefficients["block_host_s"] == pytest.approx(report["fitted"]["block_host_s"])
    # what was fitted, over the preset's own, and nothing else: under megatron the A100's fit still
    # sets what was not fitted (test_vtrain_...: under the traces' runtime it prices as the fit does)
    fitted = {name.split(".")[0] for name in report["fitted"]}
    assert set(cluster.coefficients) == fitted | set(load_cluster("dgx-a100-80g").coefficients)
    preset_megatron = Coefficients.for_cluster(load_cluster("dgx-a100-80g"), "megatron")
    for name in {"gemm_efficiency", "gemm_half_flops", "elementwise_traffic"} - fitted:
        assert getattr(Coefficients.for_cluster(cluster, "megatron"), name) == getattr(preset_megatron, name)
    # the planning commands take it, and its coefficients are used (the fitted host overhead shows)
    flags = ["--model-arg", "size=tiny", "--global-batch", "8", "--gpus-per-node", "1", "--json"]
    assert main(["estimate", "gpt", "--cluster", str(out), *flags, "--dp", "1", "--tp", "1", "--pp", "1",
                 "--micro-batch", "8"]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert main(["estimate", "gpt", "--cluster", "dgx-a100-80g", *flags, "--dp", "1", "--tp", "1", "--pp", "1",
                 "--micro-batch", "8"]) == 0
    preset = json.loads(capsys.readouterr().out)
    # the preset prices the A100's uncalibrated launch cost (Coefficients.launch_s); the fit replaces it
    assert calibrated["breakdown"]["overhead"] > preset["breakdown"]["overhead"] > 0
    assert main(["search", "gpt", "--cluster", str(out), *flags]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["dp"] == 1


@pytest.mark.heavy
def test_cli_reports_malformed_lines_and_uses_the_rest(trace_file, tmp_path, capsys):
    lines = trace_file.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    assert main(["calibrate", str(bad), "--cluster", "dgx-a100-80g", "--json"]) == 0
    captured = capsys.readouterr()
    assert f"{bad}:2: not valid JSON" in captured.err
    assert json.loads(captured.out)["rows"] == len(lines)


def test_cli_too_few_rows_says_how_many(trace_file, tmp_path, capsys):
    few = tmp_path / "few.jsonl"
    few.write_text("\n".join(trace_file.read_text().splitlines()[:3]) + "\n")
    out = tmp_path / "never.json"
    assert main(["calibrate", str(few), "--cluster", "dgx-a100-80g", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "too few measured rows to calibrate: 3 usable row(s)" in err and "needs at least" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["few.jsonl"]


@pytest.mark.slow
def test_folds_fitted_side_by_side_give_the_serial_result(trace_file):
    """--jobs runs the folds' fits and the final one in worker processes: the same figures and
    coefficients as one after another (the fits are deterministic; only where they run differs)."""
    from autopar.calibrate.calibration import calibrate

    serial, parallel = (calibrate([trace_file], "dgx-a100-80g", folds=2, params=["gemm_efficiency", "block_host_s"],
                                          jobs=jobs) for jobs in (1, 2))
    assert parallel.fit.values == pytest.approx(serial.fit.values, rel=1e-9)
    assert parallel.fit.names == serial.fit.names and len(serial.validation["folds"]) == 2
    assert [f["mape"] for f in parallel.validation["folds"]] == pytest.approx(
        [f["mape"] for f in serial.validation["folds"]], rel=1e-9)
    assert parallel.validation["mape"] == pytest.approx(serial.validation["mape"], rel=1e-9)


def test_cli_jobs_below_one_is_one_line_and_exit_2(trace_file, capsys):
    assert main(["calibrate", str(trace_file), "--cluster", "dgx-a100-80g", "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["autopar: error: --jobs must be at least 1, got 0"], err


def test_cli_unknown_schema_version_and_missing_file(trace_file, tmp_path, capsys):
    rec = json.loads(trace_file.read_text().splitlines()[0])
    rec["schema_version"] = 2
    future = tmp_path / "future.jsonl"
    future.write_text(json.dumps(rec) + "\n")
    assert main(["calibrate", str(future), "--cluster", "dgx-a100-80g"]) == 2
    err = capsys.readouterr().err
    assert "no readable trace records" in err and "1 malformed line(s)" in err
    assert "trace schema_version is 2" in err
    assert main(["calibrate", str(tmp_path / "nope.jsonl"), "--cluster", "dgx-a100-80g"]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_allreduce_only(tmp_path, capsys):
    out = tmp_path / "nvlink.json"
    tables = [str(VTRAIN / f"a100_allreduce_{n}gpu.csv") for n in (2, 4, 8)]
    assert main(["calibrate", "--cluster", "dgx-a100-80g", "--allreduce", *tables, "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    c = load_cluster(str(out)).coefficients
    assert c["link_efficiency"]["nvlink"] == pytest.approx(report["collectives"]["efficiency"])
    assert report["mape"] < 0.08
    # the tables set the link's three coefficients and nothing else: the A100's GEMM fit and the
    # runtime's elementwise traffic still come from the GPU type on the written cluster
    fitted = {"link_efficiency", "latency_scale", "collective_latency_s"}
    for runtime in ("torch", "megatron"):
        before = Coefficients.for_cluster(load_cluster("dgx-a100-80g"), runtime).to_dict()
        after = Coefficients.for_cluster(load_cluster(str(out)), runtime).to_dict()
        assert {k: v for k, v in after.items() if k not in fitted} == {k: v for k, v in before.items() if k not in fitted}
        assert {**after["link_efficiency"], "nvlink": 0} == {**before["link_efficiency"], "nvlink": 0}


# -- the vTrain figures (acceptance 1 and 2) ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.procs
def test_vtrain_single_node_cv_and_multi_node_transfer(tmp_path):
    """The full protocol of `autopar calibrate vtrain_single.jsonl --allreduce ... --folds 5
    --evaluate vtrain_multi.jsonl`: 5-fold CV by (hidden, layers) on 1,440 single-node runs
    (vTrain's simulator: 8.37% MAPE), then the multi-node runs predicted from single-node data
    only (vTrain: 14.73%), with the best-pick ratio of each of the four multi-node models."""
    from autopar.calibrate.calibration import calibrate
    from autopar.traces.vtrain import CLUSTER as VTRAIN_CLUSTER
    from autopar.traces.vtrain import import_vtrain

    started = time.perf_counter()
    single, multi = tmp_path / "single.jsonl", tmp_path / "multi.jsonl"
    write_records(single, import_vtrain(VTRAIN / "ground_truth_single.csv", predict=False))
    write_records(multi, import_vtrain(VTRAIN / "ground_truth_multi.csv", predict=False))
    tables = [VTRAIN / f"a100_allreduce_{n}gpu.csv" for n in (2, 4, 8)]
    result = calibrate([single], VTRAIN_CLUSTER, folds=5, evaluate=[multi], allreduce=tables, jobs=2)
    v = result.validation
    assert v["rows"] == 1440 and len(v["folds"]) == 5
    # 5.86% (the issue asks 6%); 6.03% with the embedding's and head's host time a layer's instead of
    # their kernel launches' (cost/launches.py), 6.19% also with the head untied from the embedding,
    # 6.68% also without Megatron's softmax fallback and fp32 loss
    assert v["mape"] <= 0.06 and v["spearman"] >= 0.95, (v["mape"], v["spearman"])
    m = result.evaluations[str(multi)]
    # 9.17% (9.11% with every block's host time a layer's; 9.16% untied) with Megatron-DeepSpeed's
    # attention and loss (switches megatron_softmax,
    # megatron_cross_entropy)
    # and the all-reduce tables weighted by log size (9.47% unweighted); 10.40% with the file's eager ops
    assert m["rows"] == 108 and m["mape"] <= 0.10, m["mape"]  # 109 runs: one plan ran twice (one row, the median)
    ratios = {g["group"].split(" on ")[0]: g["ratio"] for g in m["groups"]}
    assert len(ratios) == 4 and max(ratios.values()) <= 1.05, ratios
    # the written cluster, read back under the traces' runtime, prices exactly as the fit does
    assert Coefficients.for_cluster(result.cluster, "torch") == result.fit.coefficients
    # the fitted cluster keeps the datasheet rates: efficiencies are fractions of them
    c = Coefficients.for_cluster(result.cluster, "torch")
    assert 0 < c.link("nvlink") <= 1 and 0 < c.gemm_efficiency <= gpu_calibration("A100-SXM4-80GB").gemm_ceiling
    assert c.elementwise_traffic >= FITTED_BOUNDS["elementwise_traffic"][0]  # fused kernels still move their bytes
    print(f"vTrain: single-node 5-fold MAPE {v['mape']:.2%} Spearman {v['spearman']:.3f}; multi-node MAPE "
          f"{m['mape']:.2%}; picks {ratios}; {time.perf_counter() - started:.0f} s")


def test_dataset_subset_keeps_rows_aligned():
    ds = build_dataset(_synthetic_records(TRUE), "dgx-a100-80g")
    idx = np.array([5, 0, 17])
    sub = ds.subset(idx)
    np.testing.assert_array_equal(sub.measured, ds.measured[idx])
    np.testing.assert_allclose(sub.predict(TRUE), ds.predict(TRUE)[idx])


def test_coefficients_round_trip_through_cluster_json():
    """A fitted set of coefficients written into a cluster JSON reads back equal, every field
    included (a field to_dict dropped or from_dict ignored would come back at its default)."""
    fitted = dataclasses.replace(TRUE, link_efficiency={**TRUE.link_efficiency, "nvlink": 0.61},
                                 collective_efficiency={"all_gather": 0.7})
    default = Coefficients()
    changed = [f.name for f in dataclasses.fields(Coefficients) if getattr(fitted, f.name) != getattr(default, f.name)]
    assert len(changed) >= 3, changed
    assert Coefficients.from_dict(json.loads(json.dumps(fitted.to_dict()))) == fitted


def test_repeated_runs_of_a_plan_make_one_row_at_their_median():
    records = _synthetic_records(TRUE)[:4]
    again = [dataclasses.replace(records[1], measured={"median_step_s": records[1].measured["median_step_s"] * f})
             for f in (1.5, 0.9)]
    ds = build_dataset(records + again, "dgx-a100-80g")
    assert len(ds) == 4 and [label["runs"] for label in ds.labels] == [1, 3, 1, 1]
    assert ds.measured[1] == pytest.approx(records[1].measured["median_step_s"])  # median of 1, 1.5, 0.9


def test_records_say_what_ran_them():
    """A record's workload names its runtime and switches (vTrain's: Megatron's attention); the
    dataset prices it so, a plan run under other switches is another row, and a switch autopar does
    not know is one line naming the record. Records without the keys ran autopar's executor."""
    records = _synthetic_records(TRUE)[:2]
    switched = [dataclasses.replace(r, workload={**r.workload, "switches": ["megatron_softmax"]}) for r in records]
    ds = build_dataset(records + switched, "dgx-a100-80g")
    assert len(ds) == 4 and sorted(g.workload.switches for g in ds.groups) == [(), ("megatron_softmax",)]
    assert all(g.workload.runtime == "torch" for g in ds.groups)
    pred = ds.predict(TRUE)
    assert not np.allclose(pred[:2], pred[2:])  # the attention core priced as Megatron runs it
    bad = dataclasses.replace(records[0], workload={**records[0].workload, "switches": ["warp_drive"]})
    with pytest.raises(AutoparError, match="record 1: unknown Megatron switch"):
        build_dataset([bad], "dgx-a100-80g")


def test_calibration_takes_one_runtime(tmp_path, capsys):
    """The GPU type's fit starts the calibration differently per runtime (eager torch moves every
    profiled byte, Megatron's fused kernels fewer): traces of two runtimes are refused in one line,
    exit code 2, no file written."""
    records = _synthetic_records(TRUE)
    megatron = [dataclasses.replace(r, workload={**r.workload, "runtime": "megatron"}) for r in records[::2]]
    path, out = tmp_path / "mixed.jsonl", tmp_path / "fitted.json"
    write_records(path, records[1::2] + megatron)
    assert main(["calibrate", str(path), "--cluster", "dgx-a100-80g", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("autopar: error: the traces hold runs of 2 runtimes (megatron, torch)")
    assert "Traceback" not in err and err.count("error") == 1
    assert not out.exists()
