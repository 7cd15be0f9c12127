"""The planning CLI: JSON outputs other tools script against, and one clear line with exit
code 2 for every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar.plan import Plan
from conftest import ZOO, error_lines, run_cli

GPT = str(ZOO / "gpt.py")
TINY = ["--model-arg", "size=tiny"]


def test_search_json_and_plan_file(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "search", GPT, *TINY, "--global-batch", "64", "--top-k", "3",
                           "-o", out_path, "--json")
    assert code == 0
    d = json.loads(out)
    assert {"plan", "estimate", "alternatives"} <= set(d) and len(d["alternatives"]) == 2
    assert Plan.load(out_path) == Plan.from_dict(d["plan"])
    assert d["estimate"]["fits"] and d["plan"]["dp"] * d["plan"]["tp"] * d["plan"]["pp"] == 8
    # what the exact search proved: its plan is the space's optimum (no outer plan left unsolved by the cap)
    assert d["proved_optimal"] is True and d["outer_plans_solved"] >= 0
    code, out, _ = run_cli(capsys, "search", GPT, *TINY, "--global-batch", "64", "--method", "rules", "--json")
    assert code == 0 and "proved_optimal" not in json.loads(out)  # a heuristic proves nothing


def test_search_prints_plan_reasons_and_runners_up(capsys):
    code, out, _ = run_cli(capsys, "search", GPT, *TINY, "--global-batch", "64")
    assert code == 0
    for heading in ("Plan", "Iteration", "Memory", "Why", "Runners-up", "cost-model evaluations",
                    "(optimum proved)"):
        assert heading in out


def test_estimate_json_keys_and_consistency_with_search(capsys, tmp_path):
    path = tmp_path / "plan.json"
    run_cli(capsys, "search", GPT, *TINY, "--global-batch", "64", "-o", path, "--json")
    code, out, _ = run_cli(capsys, "estimate", GPT, *TINY, "--plan", path, "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("iteration_time_s", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "tokens_per_s",
                "peak_memory_gb", "fits", "breakdown"):
        assert key in d
    assert sum(d["breakdown"].values()) == pytest.approx(d["iteration_time_s"])


def test_estimate_from_flags_and_memory_section(capsys):
    code, out, _ = run_cli(capsys, "estimate", GPT, *TINY, "--dp", 2, "--tp", 2, "--pp", 2, "--micro-batch-size", 2,
                           "--global-batch", 16, "--recompute", "1", "--zero", 1, "--schedule", "interleaved:2",
                           "--sequence-parallel", "--bucket-mb", 5, "--json")
    assert code == 0
    plan = json.loads(out)["plan"]
    assert (plan["recompute"], plan["recompute_blocks"], plan["virtual_stages"]) == ("full", 1, 2)
    code, out, _ = run_cli(capsys, "memory", GPT, *TINY, "--dp", 8, "--micro-batch-size", 4, "--json")
    mem = json.loads(out)
    assert code == 0 and set(mem["memory_gb"]) >= {"weights", "gradients", "optimizer_states", "activations"}
    assert sum(mem["memory_gb"].values()) == pytest.approx(mem["peak_memory_gb"])


@pytest.fixture
def bad_files(tmp_path):
    files = {
        "syntax.py": "def build_model(:\n",
        "raises.py": "def build_model():\n    raise RuntimeError('boom')\ndef example_batch(b):\n    return 1, 1\n",
        "nobuild.py": "x = 1\n",
        "cpu.py": ("import torch\ndef build_model():\n    return torch.nn.Linear(4, 4, device='cpu')\n"
                   "def example_batch(b):\n    return torch.randn(b, 4), torch.randn(b, 4)\n"),
        "bad_cluster.json": '{"preset": "dgx-a100-80g",',
        "plan_unknown.json": json.dumps({**Plan(dp=1, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1).to_dict(), "foo": 2}),
        "plan_4.json": Plan(dp=4, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1).to_json(),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


BAD_INPUTS = [
    (["search", "{d}/missing.py"], "no such model file"),
    (["search", "{d}/syntax.py"], "syntax error"),
    (["search", "{d}/raises.py"], "build_model() raised (RuntimeError: boom)"),
    (["search", "{d}/nobuild.py"], "no function build_model()"),
    (["search", "{d}/cpu.py"], "off the meta device"),
    (["search", GPT, *TINY, "--cluster", "nope"], "unknown cluster 'nope'"),
    (["search", GPT, *TINY, "--cluster", "{d}/bad_cluster.json"], "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 27)"),
    (["search", GPT, *TINY, "--nodes", "8", "--global-batch", "6"], "global batch 6 is not divisible"),
    (["search", GPT, "--model-arg", "size=1t", "--global-batch", "8"], "fits no plan on 8 x"),
    (["estimate", GPT, *TINY, "--plan", "{d}/plan_unknown.json"], "unknown plan key(s) ['foo']"),
    (["estimate", GPT, *TINY, "--plan", "{d}/plan_4.json", "--nodes", "1"], "= 4 but the cluster has 8 GPUs"),
    (["estimate", GPT, *TINY, "--plan", "{d}/plan_4.json", "--global-batch", "6"], "global batch is 6"),
    (["estimate", GPT, *TINY, "--plan", "{d}/plan_4.json", "--cluster", "cpu", "--gpus-per-node", "8"],
     "the plan needs 4 GPUs, fewer than --gpus-per-node 8"),
    (["estimate", GPT, *TINY, "--dp", "8", "--tp", "3", "--micro-batch", "1", "--nodes", "3"],
     "tp=3 does not divide"),
    (["search", GPT, *TINY, "--model-arg", "oops"], "--model-arg expects KEY=VALUE"),
    (["search", GPT, *TINY, "--nodes", "0"], "--nodes must be a positive integer, got 0"),
    (["search", GPT, *TINY, "--policy", "pm.zip"], "--policy is the rl planner's, not exhaustive's; add --method rl"),
    (["search", GPT, *TINY, "--method", "rl", "--policy", "pm.zip", "--cluster", "dgx-a100-80g:1,dgx-h100:1"],
     "--policy: the rl planner of several GPU types uses the shipped policy"),
    (["search", GPT, *TINY, "--method", "random", "--storage", "sqlite:///s.db"],
     "--storage and --study-name are the optuna planner's, not random's"),
    (["search", GPT, *TINY, "--top-k", "0"], "--top-k must be at least 1"),
]


@pytest.mark.parametrize("argv, message", [  # a model file of its own is profiled in a child process: slow
    pytest.param(a, m, id=" ".join(a[:2]) + " " + m, marks=[pytest.mark.slow] * a[1].startswith("{d}/"))
    for a, m in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(capsys, bad_files, argv, message):
    code, out, err = run_cli(capsys, *[a.format(d=bad_files) for a in argv])
    assert code == 2
    lines = error_lines(err)  # a model file of its own may add the profiler's wait notice on a loaded machine
    assert len(lines) == 1 and lines[0].startswith("autopar: error: ") and message in lines[0], err


@pytest.mark.parametrize("argv", [["search", GPT, "--precision", "bf8"], ["estimate", GPT, "--zero", "5"],
                                  ["export", "plan.json", "--to", "Megatron"], ["run", "--backend", "mpi"],
                                  ["frob"], []])
def test_a_misused_flag_is_one_line_and_exit_2(capsys, argv):
    """argparse's own errors too: one line that says where the usage is, not the usage itself."""
    with pytest.raises(SystemExit) as stop:
        run_cli(capsys, *argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("autopar") and ": error: " in err and "--help)" in err and "usage:" not in err


@pytest.mark.slow
def test_bad_input_in_a_real_process_has_no_traceback(bad_files):
    proc = subprocess.run([sys.executable, "-m", "autopar", "search", str(bad_files / "raises.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(error_lines(proc.stderr)) == 1, proc.stderr


def test_nothing_written_when_search_fails(capsys, bad_files):
    out_path = bad_files / "plan.json"
    out_path.write_text("keep me")
    code, _, _ = run_cli(capsys, "search", GPT, *TINY, "--nodes", "8", "--global-batch", "6", "-o", out_path)
    assert code == 2 and out_path.read_text() == "keep me"


def test_a_failed_parity_check_is_said_in_the_title_and_the_last_line(capsys):
    """`autopar run --check-parity`: ranks that ran but left one process's losses do not read "ok"; the exit code
    (1) comes with a line saying why."""
    from types import SimpleNamespace

    from autopar.cli.run import _parity_exit, _title

    launched = SimpleNamespace(outcome="ok", wall_s=5.0)
    verdict = "differs from one process by 3.1e-02 (> 1e-05): dropout draws other masks on every rank"
    failed = {"parity_ok": False, "parity_verdict": verdict}
    assert _title(launched, failed) == "autopar run: ran, parity check failed in 5.0 s"
    assert _parity_exit(failed) == 1 and capsys.readouterr().err == f"autopar: parity check failed: {verdict}\n"
    for held in ({"parity_ok": True}, {}):
        assert _title(launched, held, " (mixed plan)") == "autopar run (mixed plan): ok in 5.0 s"
        assert _parity_exit(held) == 0 and capsys.readouterr().err == ""


def test_version(capsys):
    import autopar

    with pytest.raises(SystemExit) as stop:
        run_cli(capsys, "--version")
    assert stop.value.code == 0 and capsys.readouterr().out == f"autopar {autopar.__version__}\n"
