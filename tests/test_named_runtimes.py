"""Issue 39 point 7: named Megatron runtimes, labels that name fp32, the runners-up order said,
`autopar run --seq-len`, and the README's torchtitan and torch-wheel wording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.export import export_plan
from autopar.plan import Plan
from autopar.report import alternatives_table
from autopar.runtime import NEMO_SWITCHES, RUNTIMES, is_megatron
from autopar.workload import Workload
from conftest import profile

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
TP_PLAN = Plan(dp=2, tp=4, pp=1, micro_batch_size=1, num_micro_batches=8, zero=1, recompute="full",
               recompute_blocks=24)


def _workload(runtime, switches=()):
    return Workload(profile("gpt", size="1.7b"), load_cluster("dgx-a100-80g", nodes=1), 16, runtime=runtime,
                    switches=switches)


def test_megatron_core_is_megatron_with_nemos_switches():
    core = _workload("megatron-core")
    assert core.runtime == "megatron" and core.switches == tuple(sorted(NEMO_SWITCHES))  # stored as before
    assert estimate(core, TP_PLAN) == estimate(_workload("megatron", NEMO_SWITCHES), TP_PLAN)
    assert _workload("megatron-core", ("overlap_p2p_comm",)).switches == tuple(sorted({*NEMO_SWITCHES,
                                                                                       "overlap_p2p_comm"}))


def test_megatron_lm_2021_and_plain_megatron_price_bare_megatron():
    bare = _workload("megatron-lm-2021")
    assert bare.runtime == "megatron" and bare.switches == ()
    assert estimate(bare, TP_PLAN) == estimate(_workload("megatron"), TP_PLAN)
    assert estimate(bare, TP_PLAN).iteration_time_s > estimate(_workload("megatron-core"), TP_PLAN).iteration_time_s


def test_is_megatron_names_every_megatron_runtime():
    assert [r for r in RUNTIMES if is_megatron(r)] == ["megatron", "megatron-core", "megatron-lm-2021"]
    assert not is_megatron("torch")


def test_cli_takes_the_named_runtimes(capsys):
    gpt = ["estimate", "gpt", "--model-arg", "size=tiny", "--nodes", "1", "--gpus-per-node", "8",
           "--global-batch", "16", "--dp", "2", "--tp", "4", "--micro-batch", "1", "--json"]
    assert main([*gpt, "--runtime", "megatron-core"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["runtime"] == "megatron" and d["workload"]["megatron_switches"] == sorted(NEMO_SWITCHES)
    assert d["hidden"]["tp_comm"] > 0
    assert main([*gpt, "--runtime", "megatron-lm-2021"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["megatron_switches"] == [] and d["hidden"]["tp_comm"] == 0


def test_plan_label_names_a_precision_away_from_bf16():
    base = dict(dp=8, tp=1, pp=1, micro_batch_size=32, num_micro_batches=2, zero=1)
    assert Plan(**base).describe() == "dp8 tp1 pp1 mb 32x2 zero1"
    assert Plan(**base, precision="fp32").describe() == "dp8 tp1 pp1 mb 32x2 fp32 zero1"
    assert "fp16" in Plan(**base, precision="fp16").describe().split()


def test_runners_up_out_of_time_order_are_said():
    w = Workload(profile("gpt", size="gpt2-small"), load_cluster("dgx-a100-80g", nodes=1), 64)
    plans = [Plan(dp=8, micro_batch_size=m, num_micro_batches=8 // m) for m in (1, 2, 8)]
    (best, b), (slow, s), (mid, m) = sorted(((estimate(w, p), p) for p in plans), key=lambda e: e[0].iteration_time_s)
    assert best.iteration_time_s < slow.iteration_time_s < mid.iteration_time_s

    def caption(rows):
        console = Console(record=True, width=300)
        console.print(alternatives_table(best, rows))
        return console.export_text()

    assert "not in time order" not in caption([(s, slow), (m, mid)])
    assert "not in time order" in caption([(m, mid), (s, slow)])  # a faster row below a slower one


def test_run_takes_seq_len(monkeypatch, tmp_path, capsys):
    """`autopar run --seq-len S` reaches the model as seq_len, as search's does; a bad one is one line
    before anything starts (run_plan is stubbed: the launch is tested elsewhere)."""
    import autopar.traces.run_plan as rp

    seen = {}

    def fake_run_plan(plan, model, model_args, options, **kw):
        seen.update(model_args)
        raise SystemExit(0)

    monkeypatch.setattr(rp, "run_plan", fake_run_plan)
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dp=2, micro_batch_size=1, num_micro_batches=2).to_json())
    with pytest.raises(SystemExit):
        main(["run", str(plan), "gpt", "--model-arg", "size=tiny", "--seq-len", "64", "--nproc-per-node", "2",
              "--backend", "gloo"])
    assert seen == {"size": "tiny", "seq_len": 64}
    assert main(["run", str(plan), "gpt", "--seq-len", "0", "--nproc-per-node", "2", "--backend", "gloo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len must be positive, got 0" in err


def test_readme_says_how_torchtitan_export_ends_and_where_the_cpu_wheel_comes_from():
    text = " ".join(README.split())
    out = export_plan(Plan(dp=8, micro_batch_size=1, num_micro_batches=1, recompute="selective"), "torchtitan")
    assert out.text.split()[-1] == "activation_checkpoint:selective"
    assert "ending with its `activation_checkpoint:none|selective|full` sub-command" in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "it is the CUDA build" in text and "takes the CPU wheel rather than" not in text
