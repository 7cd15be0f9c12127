"""Measured-reward fine-tuning (`autopar train measured`) with a fake measured backend:
no real run. The loop, the budget accounting, the restricted space and the CLI's bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from autopar.envs.features import workload_features
from autopar.envs.restricted import DEFAULT_RESTRICT, RestrictedSpace
from autopar.policies.decode import beam_search, sample
from autopar.policies.load import load_policy
from autopar.policies.measured import MeasuredConfig, finetune, measured_workload, train_measured

from autopar.cli import build_parser
from autopar.cli.train import parse_restrictions
from autopar.errors import AutoparError

ARGS = {"size": "tiny", "hidden": 128, "seq_len": 64}


class FakeBackend:
    """Step time from the plan's shape, with a best no cost model would pick (pipeline depth 2,
    micro-batch 2, ZeRO 1, full recompute); counts its calls and can claim they were cached."""

    def __init__(self, cached: bool = False):
        self.calls: list = []
        self.cached = cached

    def time(self, plan) -> float:
        return (1.0 + 0.3 * abs(plan.pp - 2) + 0.2 * abs(plan.micro_batch_size - 2) + 0.1 * (plan.zero != 1)
                + 0.05 * (plan.recompute != "full") + 0.02 * plan.tp)

    def __call__(self, plan) -> dict:
        self.calls.append(plan.describe())
        return {"reward": -self.time(plan), "record": None, "cached": self.cached}


@pytest.fixture(scope="module")
def space():
    workload = measured_workload("gpt", ARGS, "cpu", 4, 8)
    return RestrictedSpace(workload, parse_restrictions([]))


@pytest.fixture()
def model():
    from autopar.policies.load import default_policy_path
    from sb3_contrib import MaskablePPO

    return MaskablePPO.load(default_policy_path(), device="cpu")


def test_restricted_space_is_small_and_its_masks_exact(space):
    assert 1 < len(space.prefixes) <= 100
    assert set(space.varying()) >= {"pp", "tp", "micro_batch_size", "zero", "recompute"}
    assert space.fixed()["schedule"] == "1f1b" and space.fixed()["grad_comm_dtype"] == "fp32"
    assert {p.zero for p in space.plans} <= {0, 1, 3} and not any(p.offload_optimizer for p in space.plans)
    assert {p.recompute for p in space.plans} == {"none", "full"}
    actor, features = load_policy(), workload_features(space.workload)
    decoded = beam_search(actor, space, features, 16) + sample(actor, space, features, 16, np.random.default_rng(0))
    assert decoded and all(d.prefix in set(space.prefixes) for d in decoded)  # every decode ends in the space


def test_finetune_respects_the_budget_and_picks_the_best_measured(space, model):
    backend = FakeBackend()
    summary = finetune(model, space, backend, MeasuredConfig(budget=12, round_size=4, fit_epochs=200))
    assert summary["budget_used"] <= 12 and summary["budget_used"] == len(backend.calls)
    assert len(set(backend.calls)) == len(backend.calls)  # each distinct plan measured once
    assert summary["runs_now"] == summary["budget_used"] and summary["from_cache"] == 0
    measured = [m["measured_s"] for m in summary["measurements"]]
    assert summary["pick"]["measured_s"] == pytest.approx(min(measured))
    assert summary["prior_pick"]["describe"] == summary["measurements"][0]["describe"]


def test_budget_counts_cached_measurements_and_can_find_the_best(space, model):
    small = RestrictedSpace(space.workload, parse_restrictions(["micro_batch_size=2", "zero=0,1"]))
    backend = FakeBackend(cached=True)
    summary = finetune(model, small, backend, MeasuredConfig(budget=len(small.prefixes) + 5))
    assert summary["budget_used"] == len(small.prefixes) and summary["runs_now"] == 0  # the space is all there is
    assert summary["from_cache"] == summary["budget_used"]
    best = min(backend.time(p) for p in small.plans)
    assert summary["pick"]["measured_s"] == pytest.approx(best)


def test_bad_budget_and_restrictions(space, model):
    with pytest.raises(AutoparError, match="budget"):
        finetune(model, space, FakeBackend(), MeasuredConfig(budget=0))
    with pytest.raises(AutoparError, match="unknown knob"):
        parse_restrictions(["zeros=0,1"])
    with pytest.raises(AutoparError, match="KNOB=VALUE"):
        parse_restrictions(["zero"])
    assert "zero" not in parse_restrictions(["zero=*"]) and parse_restrictions([])["zero"] == DEFAULT_RESTRICT["zero"]
    with pytest.raises(AutoparError, match="more than 3 plans"):
        RestrictedSpace(space.workload, parse_restrictions([]), max_plans=3)
    for item, offered in (("zero=9", "zero = 0, 1, 2, 3"), ("schedule=foo", "schedule = ")):  # named, not 'relax'
        with pytest.raises(AutoparError, match=f"--restrict {item}: the plan space offers {offered}"):
            RestrictedSpace(space.workload, parse_restrictions([item]))


def test_the_restrict_help_shows_the_default_restriction(capsys):
    """`autopar train measured --help` says what DEFAULT_RESTRICT is, knob by knob."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "measured", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for knob, values in DEFAULT_RESTRICT.items():
        assert f"{knob}={','.join(values)}" in text


@pytest.mark.slow
def test_train_measured_writes_a_policy(tmp_path):
    out = tmp_path / "policy.zip"
    meta = train_measured("gpt", ARGS, cluster="cpu", gpus_per_node=4, global_batch=8,
                          restrict=parse_restrictions(["micro_batch_size=2,4"]), budget=5, output=str(out),
                          backend=FakeBackend())
    m = meta["measured"]
    assert m["budget_used"] <= 5 and m["pick"]["measured_s"] is not None
    assert out.is_file() and json.loads(out.with_suffix(".json").read_text())["measured"]["budget"] == 5
    assert zipfile.is_zipfile(out)
    load_policy(out)  # a usable policy


@pytest.mark.parametrize("extra,message", [(["--budget", "0"], "--budget"), (["--restrict", "zeros=1"], "unknown knob"),
                                           ([], "needs a MODEL")])
@pytest.mark.slow
def test_cli_bad_input_is_one_line_exit_2(tmp_path, extra, message):
    argv = [sys.executable, "-m", "autopar", "train", "measured", *(["gpt"] if extra else []), *extra,
            "-o", str(tmp_path / "p.zip")]
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = [line for line in (res.stderr + res.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "p.zip").exists()


def test_the_old_flag_form_runs_the_sub_command_with_a_note(tmp_path, capsys):
    from autopar.cli import main

    out = tmp_path / "p.zip"
    assert main(["train", "--reward", "measured", "gpt", "--budget", "0", "-o", str(out)]) == 2
    note, error = capsys.readouterr().err.strip().splitlines()
    assert "deprecated" in note and "`autopar train measured ...`" in note and "--budget" in error
    assert main(["train", "--reward", "best", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("autopar: error: --reward takes cost or measured, got 'best'; use "
                                               "`autopar train cost|measured ...`")
    assert not out.exists()
    from autopar.cli.train import modernize

    assert modernize(["train", "--traces", "a.jsonl", "b.jsonl", "--cluster", "c"]) == \
        ["train", "traces", "a.jsonl", "b.jsonl", "--cluster", "c"]
    assert modernize(["train", "--workloads", "8", "-o", "p.zip"]) == ["train", "cost", "--workloads", "8", "-o", "p.zip"]
    assert modernize(["train", "--reward", "cost"]) == ["train", "cost"]
    assert len(capsys.readouterr().err.strip().splitlines()) == 3  # one note each
    for new in (["train", "cost", "--workloads", "8"], ["train", "measured", "gpt"], ["train", "--help"], ["train"]):
        assert modernize(new) == new
    assert capsys.readouterr().err == ""
