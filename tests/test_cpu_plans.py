"""CPU plans a user can run at once (issue 39, point 1): mixed precision and torch.compile are chosen
only where the device runs them faster, and priced so; the README's "Apply a plan" search, run in
process, gives the plan its `autopar run` command trains fast and with fp32 parity."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import workload

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.executor.parity import TOLERANCES
from autopar.knobs import default_precision
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[list[str]]:
    """The shell commands of the README's "Apply a plan" section, as argument lists."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Apply a plan\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:1]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.parametrize("gpu, precision", [("cpu", "fp32"), ("a100-80g", "bf16"), ("h100", "bf16"),
                                            ("v100-32g", "fp16")])
def test_the_default_precision_is_mixed_only_where_the_device_runs_it_faster(gpu, precision):
    from autopar.cluster.gpus import GPUS

    assert default_precision(GPUS[gpu]) == precision


def test_compile_is_priced_as_no_gain_on_the_cpu_preset_and_a_gain_on_a_gpu():
    cpu = workload("gpt", "cpu", gpus_per_node=2, global_batch=16, dtype="fp32", size="tiny")
    eager = Plan(dp=2, micro_batch_size=8, num_micro_batches=1, precision="fp32")
    assert estimate(cpu, eager.with_(compile=True)).iteration_time_s >= estimate(cpu, eager).iteration_time_s
    gpu = workload("gpt", "dgx-a100-80g", global_batch=64, size="gpt2-small")
    plan = Plan(dp=8, micro_batch_size=8, num_micro_batches=1)
    assert estimate(gpu, plan.with_(compile=True)).iteration_time_s < estimate(gpu, plan).iteration_time_s


def test_the_readme_search_plans_fp32_eager_data_parallel_on_two_cpu_processes(capsys, tmp_path, monkeypatch):
    search, run = readme_commands()
    assert search[:2] == ["autopar", "search"] and run[:2] == ["autopar", "run"]
    assert "--check-parity" in run and "--no-dropout" in run  # dropout masks differ by rank: no exact parity
    (tmp_path / "autopar").symlink_to(ROOT / "autopar")  # the README's paths are the clone's
    monkeypatch.chdir(tmp_path)
    assert main(search[1:]) == 0
    capsys.readouterr()
    plan = Plan.load(tmp_path / search[search.index("-o") + 1])
    # what runs fast on 2 gloo processes: no autocast (16-bit matmuls are far slower than fp32 on a CPU
    # without native bf16), no torch.compile (minutes of compiling, slower steps), plain data parallelism
    assert plan.precision == "fp32" and not plan.compile
    assert (plan.dp, plan.tp, plan.pp, plan.recompute) == (2, 1, 1, "none")
    assert plan.world_size == int(run[run.index("--nproc-per-node") + 1])
    assert TOLERANCES[plan.precision] == 1e-5  # --check-parity holds it to fp32's tolerance
    assert load_cluster("cpu").gpu.peak_flops["bf16"] <= load_cluster("cpu").gpu.peak_flops["fp32"]
