"""Issue 14, point 7: bad MoE input is one line, exit 2, before anything runs or is written:
--ep that does not divide the experts or the data-parallel group, an ep plan for a dense model,
an MoE workload setting for a dense model, an ep plan the executor cannot run; and the good
path: `estimate --ep` and `search` see the ep axis of an MoE model."""

import json

import pytest

from autopar.cli import main
from autopar.plan import Plan

TINY_MOE = ["moe", "--model-arg", "size=tiny"]
TINY_GPT = ["gpt", "--model-arg", "size=tiny"]
COMMON = ["--cluster", "cpu", "--global-batch", "16"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def _one_line_exit_2(capsys, args, expected: str) -> None:
    code = main(args)
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("autopar: error: "), (code, err)
    assert expected in err[0], err[0]
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("args, expected", [
    ([*TINY_MOE, "--dp", "4", "--ep", "3"], "ep=3 must divide dp x cp = 4"),
    ([*TINY_MOE, "--dp", "2", "--tp", "2", "--ep", "4"], "ep=4 must divide dp x cp = 2"),
    ([*TINY_MOE, "--model-arg", "experts=6", "--dp", "4", "--ep", "4"], "ep=4 does not divide the model's 6 experts"),
    ([*TINY_GPT, "--dp", "4", "--ep", "2"], "is a dense model (no experts to shard); use ep 1"),
    ([*TINY_GPT, "--dp", "4", "--expert-imbalance", "1.5"], "--expert-imbalance 1.5 applies to mixture-of-experts"),
    ([*TINY_MOE, "--dp", "4", "--expert-imbalance", "0.5"], "must be at least 1.0"),
])
def test_estimate_refuses_bad_moe_input_in_one_line(args, expected, capsys):
    _one_line_exit_2(capsys, ["estimate", *args, "--micro-batch-size", "4", *COMMON], expected)


def test_an_ep_plan_for_a_dense_model_is_refused_by_run_before_launch(tmp_path, capsys):
    Plan(dp=4, ep=2, micro_batch_size=4, precision="fp32").save(tmp_path / "p.json")
    _one_line_exit_2(capsys, ["run", str(tmp_path / "p.json"), *TINY_GPT, "--nproc-per-node", "4", "--backend", "gloo",
                              "--trace", str(tmp_path / "t.jsonl"), "--cluster", "cpu"], "is a dense model")
    assert not (tmp_path / "t.jsonl").exists()


def test_an_ep_plan_with_zero1_is_refused_by_run_before_launch(tmp_path, capsys):
    Plan(dp=4, ep=2, zero=1, micro_batch_size=4, precision="fp32").save(tmp_path / "p.json")
    _one_line_exit_2(capsys, ["run", str(tmp_path / "p.json"), *TINY_MOE, "--nproc-per-node", "4", "--backend", "gloo",
                              "--cluster", "cpu"], "zero 1 with ep=2: ZeRO-1's optimizer would broadcast")


def test_estimate_prices_an_ep_plan_and_search_offers_ep_only_for_moe(capsys):
    assert main(["estimate", *TINY_MOE, "--dp", "4", "--ep", "2", "--micro-batch-size", "4", *COMMON, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["ep"] == 2 and out["workload"]["experts"] == 8 and out["workload"]["expert_imbalance"] == 1.0
    for model, eps in ((TINY_MOE, {1, 2, 4}), (TINY_GPT, {1})):
        assert main(["search", *model, *COMMON, "--method", "exhaustive", "--top", "200", "--json"]) == 0
        found = json.loads(capsys.readouterr().out)
        assert {p["plan"]["ep"] for p in [found, *found["alternatives"]]} == eps
