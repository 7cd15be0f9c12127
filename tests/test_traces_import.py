"""vTrain CSV import, trace files, and `autopar traces show`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.errors import AutoparError
from autopar.traces.record import TraceRecord, read_records
from autopar.traces.vtrain import COLUMNS, import_vtrain, read_vtrain_csv, write_records
from conftest import VTRAIN

HEADER = ",".join(COLUMNS)


def _csv(path: Path, rows: list[str], header: str = HEADER, bom: bool = True) -> Path:
    path.write_text(("\ufeff" if bom else "") + header + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


# GPUs, global batch, micro batch, hidden, heads, layers, seq, tp, dp, pp, ms
SMALL = ["2,8,2,256,4,4,128,1,1,2,50.5", "4,8,1,256,4,4,128,2,2,1,40.0", "8,16,2,512,8,4,128,2,2,2,80.0",
         "2,4,4,256,4,4,128,1,1,2,30.0"]


def test_reads_both_published_files():
    single = read_vtrain_csv(VTRAIN / "ground_truth_single.csv")
    multi = read_vtrain_csv(VTRAIN / "ground_truth_multi.csv")
    assert len(single) == 1440 and len(multi) == 109  # docs/references.md §5
    assert {r.gpus for r in single} == {2, 4, 8}
    assert {r.params_billion for r in multi} == {3.6, 18.4, 39.1, 175.0}
    assert single[0].line == 2 and single[0].hidden == 1024  # the BOM does not hide the first column


def test_import_builds_megatron_plans(tmp_path):
    records = import_vtrain(_csv(tmp_path / "v.csv", SMALL), "dgx-a100-80g")
    assert len(records) == 4
    r = records[0]
    assert r.outcome == "ok" and r.measured["median_step_s"] == pytest.approx(0.0505)
    assert r.measured["source"].endswith("v.csv:2")
    assert r.cluster == {"name": "dgx-a100-80g", "nodes": 1, "gpus_per_node": 2, "gpu": "A100-SXM4-80GB",
                         "backend": "nccl"}
    assert r.model["args"] == {"hidden": 256, "heads": 4, "layers": 4, "vocab": 51200, "seq_len": 128}
    # Megatron-DeepSpeed ran it: Megatron's attention kernels and fp32 loss, not the model file's eager ops
    assert r.workload == {"global_batch": 8, "seq_len": 128, "runtime": "torch",
                          "switches": ["megatron_cross_entropy", "megatron_softmax"]}
    p = r.plan
    assert (p["dp"], p["tp"], p["pp"], p["micro_batch_size"], p["num_micro_batches"]) == (1, 1, 2, 2, 4)
    assert (p["recompute"], p["recompute_blocks"], p["schedule"], p["precision"], p["zero"]) == \
        ("full", 2, "1f1b", "fp16", 0)
    assert records[1].plan["bucket_mb"] >= 2 * records[1].model["params"] / 2**20  # one bucket: no overlap
    assert records[3].plan["schedule"] == "gpipe"  # 1 micro-batch on 2 stages: 1F1B degenerates to GPipe
    assert records[2].cluster["gpus_per_node"] == 8 and records[2].predicted["iteration_time_s"] > 0
    # records survive the trace file format
    write_records(tmp_path / "t.jsonl", records)
    back, problems = read_records(tmp_path / "t.jsonl")
    assert problems == [] and [b.to_dict() for b in back] == [TraceRecord.from_dict(r.to_dict()).to_dict()
                                                              for r in records]


def test_multi_node_rows_fill_nodes_of_eight(tmp_path):
    header = "Parameters (billion)," + HEADER
    rows = ["0.1,64,64,1,256,4,4,128,1,64,1,100.0", "0.1,16,16,1,256,4,4,128,2,4,2,100.0"]
    records = import_vtrain(_csv(tmp_path / "m.csv", rows, header), "dgx-a100-80g", predict=False)
    assert [(r.cluster["nodes"], r.cluster["gpus_per_node"]) for r in records] == [(8, 8), (2, 8)]
    assert records[0].predicted is None


@pytest.mark.parametrize("rows, header, message", [
    (SMALL, HEADER.replace(",tensor parallelism", ""), "missing column(s) 'tensor parallelism'"),
    (["2,8,2,256,4,4,128,1,1,2,fast"], HEADER, "bad.csv:2: column 'iteration time (ms)' is 'fast'"),
    (["2,8,2,256,4,4,128,1,1,2,50", "4,8,2,256,4,4,128,1,1,2,50"], HEADER, "bad.csv:3: tp x dp x pp"),
    ([], HEADER, "no rows"),
])
def test_bad_csv_is_a_clear_error(tmp_path, rows, header, message):
    path = _csv(tmp_path / "bad.csv", rows, header)
    with pytest.raises(AutoparError, match=re.escape(message)):
        import_vtrain(path, "dgx-a100-80g", predict=False)


def test_cli_import_bad_csv_exits_2_without_output(tmp_path, capsys):
    bad = _csv(tmp_path / "bad.csv", SMALL, HEADER.replace("# GPUs,", ""))
    out = tmp_path / "out.jsonl"
    assert main(["traces", "import", "vtrain", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "missing column(s) '# GPUs'" in err and err.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]  # no partial or temporary file


def test_cli_import_and_show(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["traces", "import", "vtrain", str(_csv(tmp_path / "v.csv", SMALL)), "-o", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 4 and summary["cluster_sizes"] == ["1x2", "1x4", "1x8"]
    # a malformed line and an unknown schema version: reported with line numbers, the rest used
    lines = out.read_text().splitlines()
    future = json.loads(lines[1])
    future["schema_version"] = 99
    out.write_text("\n".join([lines[0], json.dumps(future), "{not json", *lines[2:]]) + "\n")
    assert main(["traces", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["records"] == 3 and shown["outcomes"] == {"ok": 3}
    assert [(m["line"], m["message"][:20]) for m in shown["malformed"]] == \
        [(2, "trace schema_version"), (3, "not valid JSON (Expe")]
    assert "schema_version is 99" in shown["malformed"][0]["message"]
    assert main(["traces", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 malformed line(s)" in text and "line 3: not valid JSON" in text
    assert main(["traces", "show", str(tmp_path / "missing.jsonl")]) == 2


def test_collect_chooses_the_planners_best_then_distinct_plans():
    from conftest import workload

    from autopar.cost import estimate
    from autopar.search.exhaustive import ExhaustivePlanner
    from autopar.traces.collect import choose_plans

    w = workload("gpt", cluster="cpu", nodes=1, gpus_per_node=4, global_batch=16, dtype="fp32", size="tiny")
    plans = choose_plans(w, 8, seed=0)
    assert len(plans) == 8 and plans[0] == ExhaustivePlanner().propose(w, 1)[0]
    structures = {(p.dp, p.tp, p.pp, p.micro_batch_size, p.recompute, p.zero) for p in plans}
    assert len(structures) == 8  # no two differ only in a detail the step time hardly sees
    assert all(estimate(w, p).fits for p in plans)
    assert all(not p.offload_optimizer and p.schedule != "interleaved" for p in plans[1:])
    assert [p.describe() for p in choose_plans(w, 8, seed=0)] == [p.describe() for p in plans]


@pytest.mark.parametrize("flags, flag", [(["--plans", "0"], "--plans"),
                                         (["--plans", "2", "--repeats", "0"], "--repeats")])
def test_cli_collect_bad_counts_exit_2_without_output(flags, flag, tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["traces", "collect", "gpt", *flags, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"autopar: error: {flag} must be at least 1, got 0"
    assert not out.exists()
