"""experiments/gpu_smoke.py stays runnable: it lists every check the GPU smoke needs, and every
check runs here: the CPU-capable ones pass on gloo, the CUDA-only ones say they need a GPU (on a
GPU machine all of them run, on NCCL with world size 1)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "gpu_smoke.py"
CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@pytest.fixture(scope="module")
def smoke():
    """The script as a module; its global settings (deterministic algorithms, TF32) undone after."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ.get(CUBLAS))
    yield module
    if dist.is_initialized():
        dist.destroy_process_group()
    enabled, warn_only, matmul, conv, cudnn_deterministic, benchmark, cublas = settings
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = matmul, conv
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
    if cublas is None:
        os.environ.pop(CUBLAS, None)


def test_every_check_the_gpu_smoke_needs_is_there(smoke):
    names = " | ".join(smoke.CHECKS).lower()
    for needed in ("backend and devices", "peak memory", "event vs wall", "tf32 on", "tf32 off", "bf16 selective",
                   "bf16 full", "fp16 selective", "fp16 full", "selective recompute memory", "zero3 offload",
                   "dcp save zero3, load zero0", "autopar run --check-parity", "cuda oom"):
        assert needed in names, needed


GPU_ONLY = {"vit fp32, TF32 on (cuDNN default): parity", "gpt bf16 selective recompute memory with dropout",
            "cuda oom and single-rank tests (pytest)",
            "gpt bf16 compiled blocks as CUDA graphs, selective recompute: parity in bf16"}


@pytest.mark.slow
def test_every_check_runs_and_passes_or_says_it_needs_a_gpu(smoke, capsys):
    """The whole script, as on a GPU machine: one JSON line per check, in order; here the
    CUDA-only checks say so, every other check passes (on NCCL with a GPU: all of them)."""
    code = smoke.main([])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["check"] for line in lines] == list(smoke.CHECKS)
    skipped = {line["check"] for line in lines if "skipped" in line}
    assert skipped == (set() if torch.cuda.is_available() else GPU_ONLY)
    failed = [line for line in lines if "skipped" not in line and line["ok"] is not True]
    assert not failed and code == 0, failed
    by_name = {line["check"]: line for line in lines}
    fp16 = by_name["gpt fp16 selective recompute (loss scaling): parity in fp16"]
    assert fp16["parity_tolerance"] == 4e-5 and fp16["parity_reference"].endswith("fp16")
    assert by_name["dcp save zero3, load zero0"]["step"] == 2
    run = by_name["autopar run --check-parity (torchrun)"]
    assert run["outcome"] == "ok" and run["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
