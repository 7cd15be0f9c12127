"""FP8 where there are no fp8 tensor cores: refused in one line with exit code 2 (`autopar estimate`,
`search`, `run`), before a model is profiled or a process starts; and torch.compile of the blocks
runs on the CPU (fp32, bf16) with the losses of the uncompiled model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import profile

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import AutoparError, PlanError
from autopar.executor.parity import reference_losses
from autopar.executor.facts import device_facts
from autopar.executor.support import refusal
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.workload import Workload

GPT = load_model_file("gpt")
ARGS = {"size": "tiny", "dropout": 0.0}
FP8_PLAN = Plan(dp=1, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2, precision="fp8", fp8_recipe="tensorwise")


def _refused(capsys, argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert words in err, err


@pytest.mark.parametrize("command", [
    ["estimate", "gpt", "--dp", "8", "--micro-batch-size", "1"],
    ["search", "gpt", "--global-batch", "8", "--method", "exhaustive"],
])
@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "cpu"])
def test_estimate_and_search_refuse_fp8_without_fp8_tensor_cores(capsys, command, cluster):
    _refused(capsys, [*command, "--model-arg", "size=tiny", "--cluster", cluster, "--nodes", "1",
                      "--gpus-per-node", "8", "--precision", "fp8"], "precision fp8 needs a GPU with fp8 tensor cores")


def test_estimate_of_an_fp8_plan_on_h100_runs(capsys):
    assert main(["estimate", "gpt", "--model-arg", "size=tiny", "--cluster", "dgx-h100", "--nodes", "1",
                 "--dp", "8", "--micro-batch-size", "1", "--global-batch", "8", "--precision", "fp8",
                 "--compile", "--json"]) == 0
    assert '"precision": "fp8"' in capsys.readouterr().out


def test_an_fp8_plan_file_is_explained_in_its_own_precision(capsys, tmp_path):
    path = tmp_path / "plan.json"
    Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, precision="fp8", fp8_recipe="rowwise",
         compile=True).save(path)
    assert main(["explain", str(path), "gpt", "--model-arg", "size=tiny", "--cluster", "dgx-h100", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp8 rowwise scaling" in out and "torch.compile of each block on" in out


def test_mxfp8_is_refused_before_blackwell(capsys):
    _refused(capsys, ["estimate", "gpt", "--model-arg", "size=tiny", "--cluster", "dgx-h100", "--nodes", "1",
                      "--dp", "8", "--micro-batch-size", "1", "--global-batch", "8", "--precision", "fp8",
                      "--fp8-recipe", "mxfp8"], "mxfp8")


def test_run_refuses_an_fp8_plan_on_cpu_before_launching(capsys, tmp_path):
    path = tmp_path / "plan.json"
    FP8_PLAN.save(path)
    _refused(capsys, ["run", str(path), "gpt", "--model-arg", "size=tiny", "--nproc-per-node", "1",
                      "--backend", "gloo"], "precision fp8 needs CUDA GPUs")
    assert list(tmp_path.iterdir()) == [path]  # nothing launched, nothing written


def test_the_executor_refuses_fp8_on_gloo_and_on_the_cpu_device():
    assert "CPU" in refusal(FP8_PLAN, "gloo")
    assert refusal(FP8_PLAN, "nccl") is None
    cpu = device_facts(torch.device("cpu"))
    assert "this run is on cpu: use precision bf16" in refusal(FP8_PLAN, "nccl", device=cpu)
    assert refusal(Plan(dp=1, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2), "nccl", device=cpu) is None
    with pytest.raises(PlanError, match="fp8_recipe 'none' with precision fp8"):
        Plan(dp=1, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2, precision="fp8")


@pytest.mark.parametrize("recipe, zero", [("tensorwise", 3), ("rowwise", 0)])
def test_fp8_converts_the_blocks_linears_with_torchaos_recipe(recipe, zero):
    """The conversion the CUDA path runs (it needs no GPU): every block linear becomes torchao's
    Float8Linear with the plan's recipe (fp8 all-gather under FSDP2 with tensorwise), the head stays."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from autopar.executor.precision import convert_fp8

    model = GPT.build(size="tiny", dropout=0.0)
    plan = Plan(dp=2, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2, precision="fp8", fp8_recipe=recipe,
                zero=zero)
    convert_fp8(list(GPT.blocks(model)), plan)
    linears = [m for b in GPT.blocks(model) for m in b.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Float8Linear) for m in linears)
    expected = Float8LinearConfig.from_recipe_name(recipe)
    assert all(m.config.cast_config_input == expected.cast_config_input for m in linears)
    assert all(m.config.enable_fsdp_float8_all_gather == (recipe == "tensorwise" and zero == 3) for m in linears)
    assert type(model.output) is torch.nn.Linear


def test_a_workload_refuses_fp8_on_an_a100():
    with pytest.raises(AutoparError, match="A100-SXM4-80GB has none"):
        Workload(profile("gpt", size="tiny"), load_cluster("dgx-a100-80g"), 8, fp8=True)


@pytest.fixture
def one_rank_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_model_on_cpu(one_rank_world, precision):
    """torch.compile of each block (in place, names kept) on gloo: the same losses as one eager process."""
    p = Plan(dp=1, tp=1, pp=1, micro_batch_size=2, num_micro_batches=2, precision=precision, compile=True)
    build = lambda: GPT.build(**ARGS)  # noqa: E731
    optimizer = lambda params: torch.optim.SGD(params, lr=2.0)  # noqa: E731
    torch.manual_seed(1)
    batch = GPT.example_batch(p.global_batch, device="cpu", **ARGS)
    par = apply(p, build, optimizer, GPT.loss_fn, blocks=GPT.blocks, backend="gloo")
    blocks = GPT.blocks(par.model)
    assert all(b._compiled_call_impl is not None for b in blocks)  # compiled in place
    losses = par.global_losses([par.train_step(*par.local_batch(*batch)) for _ in range(3)])
    reference = reference_losses(build, optimizer, GPT.loss_fn, [batch] * 3, precision=precision)
    assert losses == pytest.approx(reference, rel=1e-5 if precision == "fp32" else 2e-2)
