"""experiments/gpu_smoke.py stays runnable: it lists every check the GPU smoke needs, and its
CPU-capable checks pass here on gloo (on a GPU machine, on NCCL with world size 1)."""

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


def test_its_cpu_capable_checks_pass(smoke, capsys):
    assert smoke.main(["--only", "backend"]) == 0
    assert smoke.main(["--only", "gpt fp32 zero0"]) == 0
    assert smoke.main(["--only", "gpt fp16 selective"]) == 0
    assert smoke.main(["--only", "dcp"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["ok"] for line in lines] == [True] * 4
    fp16 = lines[2]
    assert fp16["parity_tolerance"] == 4e-5 and fp16["parity_reference"].endswith("fp16")
    assert lines[3]["step"] == 2
