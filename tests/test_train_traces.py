"""`autopar train traces`: calibrate on traces, train on their job mix, evaluate on held-out shapes."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from autopar.cli import main
from conftest import VTRAIN

MEGATRON_GPT = Path(__file__).resolve().parents[1] / "autopar" / "traces" / "megatron_gpt.py"
TINY = ["--timesteps", "64", "--n-steps", "32", "--imitation-epochs", "2", "--dagger-rounds", "1",
        "--eval-every", "64", "--checkpoint-every", "64", "--replay", "0"]


def _vtrain_subset(tmp_path: Path, picks: dict, per_pick: int = 6) -> Path:
    """A vTrain CSV of the first `per_pick` rows of each (hidden, layers) -> (GPUs, global batch),
    imported to a trace file."""
    from autopar.traces.vtrain import import_vtrain, write_records

    with open(VTRAIN / "ground_truth_single.csv", encoding="utf-8-sig") as f:
        lines = f.read().splitlines()
    header, rows = lines[0], list(csv.reader(lines[1:]))
    taken = {k: 0 for k in picks}
    keep = []
    for line, row in zip(lines[1:], rows):
        key = (int(row[3]), int(row[5]))  # hidden size, layers
        if key in picks and (int(row[0]), int(row[1])) == picks[key] and taken[key] < per_pick:
            taken[key] += 1
            keep.append(line)
    assert all(n == per_pick for n in taken.values()), taken
    tmp_path.mkdir(parents=True, exist_ok=True)
    subset = tmp_path / "subset.csv"
    subset.write_text("\n".join([header, *keep]) + "\n")
    traces = tmp_path / "traces.jsonl"
    write_records(traces, import_vtrain(subset, predict=False))
    return traces


@pytest.mark.slow
def test_train_on_vtrain_rows(tmp_path, capsys):
    # three shapes: one at 4 GPUs and batch 8, one at 2 GPUs and batch 16, one at 4 GPUs and batch 8
    traces = _vtrain_subset(tmp_path, {(1024, 12): (4, 8), (1024, 16): (2, 16), (2048, 12): (4, 8)})
    out = tmp_path / "pol" / "policy.zip"
    assert main(["train", "traces", str(traces), "--cluster", "dgx-a100-80g", "--holdout", "0.3", *TINY,
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out trace workloads" in printed and "median" in printed

    cluster_json = out.with_suffix(".cluster.json")
    meta = json.loads(out.with_suffix(".json").read_text())
    t = meta["traces"]
    assert t["files"] == [{"path": str(traces), "sha256": hashlib.sha256(traces.read_bytes()).hexdigest()}]
    # in-sample on 18 rows: 6.5% today (was only checked to be >= 0)
    assert t["calibration"]["rows"] == 18 and 0 < t["calibration"]["mape"] <= 0.12 and t["calibration"]["fitted"]
    split = t["split"]
    assert split["heldout_shapes"] and split["train_shapes"]
    assert not set(split["heldout_shapes"]) & set(split["train_shapes"])
    # training shapes at every traced cluster size and batch: 2 sizes x 2 batches each (all fit)
    assert split["train_pool"] == 4 * len(split["train_shapes"])
    h = t["heldout"]
    assert h["workloads"] == split["heldout_workloads"] == len(h["rows"]) >= 1
    assert 0 < h["min"] <= h["p5"] <= h["median"] <= 1
    assert meta["started_from"].endswith("default_policy.zip") and split["replay"] == 0
    coefficients = json.loads(cluster_json.read_text())["coefficients"]
    assert coefficients == t["coefficients"] == meta["cluster"]["coefficients"]
    assert coefficients["block_host_s"] != 0  # calibrated, not the preset's

    # the policy loads (metadata in the zip too) and plans on the calibrated cluster
    from autopar.policies.load import load_policy, read_meta

    assert read_meta(out)["traces"]["heldout"]["median"] == h["median"]
    load_policy(out)
    plan_json = tmp_path / "plan.json"
    assert main(["search", str(MEGATRON_GPT), "--method", "rl", "--policy", str(out), "--cluster", str(cluster_json),
                 "--nodes", "1", "--gpus-per-node", "4", "--global-batch", "8", "--precision", "fp16",
                 "--model-arg", "hidden=1024", "--model-arg", "heads=16", "--model-arg", "layers=20",
                 "--model-arg", "seq_len=1024", "--model-arg", "vocab=51200", "-o", str(plan_json)]) == 0
    assert json.loads(plan_json.read_text())["dp"] >= 1


def _one_line_error(capsys, argv, match: str, output: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error:") and "\n" not in err and match in err, err
    assert not output.exists()


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    out = tmp_path / "policy.zip"
    base = ["--cluster", "dgx-a100-80g", "-o", str(out)]
    _one_line_error(capsys, ["train", "traces", *base], "at least one trace file", out)
    _one_line_error(capsys, ["train", "traces", str(tmp_path / "missing.jsonl"), *base], "not found", out)
    _one_line_error(capsys, ["train", "traces", str(tmp_path / "missing.jsonl"), "-o", str(out)], "--cluster", out)
    _one_line_error(capsys, ["train", "traces", str(tmp_path / "missing.jsonl"), "--replay", "-1", *base],
                    "--replay must be 0 or more", out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _one_line_error(capsys, ["train", "traces", str(empty), *base], "no readable trace records", out)


def test_too_few_rows_and_one_shape(tmp_path, capsys):
    out = tmp_path / "policy.zip"
    few = _vtrain_subset(tmp_path / "few", {(1024, 12): (4, 8)}, per_pick=2)
    _one_line_error(capsys, ["train", "traces", str(few), "--cluster", "dgx-a100-80g", "-o", str(out)],
                    "too few measured rows", out)
    one = _vtrain_subset(tmp_path / "one", {(1024, 12): (4, 8)}, per_pick=10)
    _one_line_error(capsys, ["train", "traces", str(one), "--cluster", "dgx-a100-80g", "-o", str(out)],
                    "at least 2", out)


def test_replay_default_is_one_number():
    from autopar.policies.traces import REPLAY, TraceTrainConfig

    from autopar.cli.train import REPLAY as CLI_REPLAY

    assert CLI_REPLAY == REPLAY == TraceTrainConfig([], "dgx-a100-80g").replay
