"""Device and backend choice, and failure classification, without GPUs: CUDA's presence, device
count and process-group calls are faked, so these run on any machine (GPU or not)."""

import pytest
import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.executor import mesh
from autopar.executor.outcome import is_oom, killed_by, oom_kills


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs; no launcher variables."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def have(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


def test_auto_picks_nccl_only_with_a_gpu_for_every_local_rank(gpus, monkeypatch):
    gpus(1)
    assert mesh.resolve_backend("auto", local_ranks=1) == "nccl"
    assert mesh.resolve_backend("auto", local_ranks=4) == "gloo"  # NCCL refuses two ranks on one GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, inside a worker
    assert mesh.resolve_backend("auto") == "gloo"
    gpus(8)
    assert mesh.resolve_backend("auto") == "nccl"
    gpus(0)
    assert mesh.resolve_backend("auto", local_ranks=1) == "gloo"


def test_nccl_with_too_few_gpus_is_refused_with_a_fix(gpus):
    gpus(2)
    assert mesh.resolve_backend("nccl", local_ranks=2) == "nccl"
    with pytest.raises(PlanError, match=r"4 rank\(s\) per node but 2 GPU\(s\) visible; use --nproc-per-node 2"):
        mesh.resolve_backend("nccl", local_ranks=4)
    gpus(0)
    with pytest.raises(PlanError, match="needs CUDA GPUs and none is available"):
        mesh.resolve_backend("nccl", local_ranks=1)


@pytest.mark.parametrize("env,expected", [
    ({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 3),  # torchrun first
    ({"SLURM_LOCALID": "2", "RANK": "7"}, 2),  # srun
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "RANK": "5"}, 1),  # mpirun
    ({"RANK": "6"}, 2),  # none: the global rank modulo the node's 4 GPUs
])
def test_local_rank_from_any_launcher(gpus, monkeypatch, env, expected):
    gpus(4)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert mesh.local_rank() == expected


@pytest.mark.parametrize("backend,device", [("nccl", "cuda:1"), ("cpu:gloo,cuda:nccl", "cuda:1"), ("gloo", "cpu")])
def test_the_group_decides_the_device_and_nccl_gets_it_as_device_id(gpus, monkeypatch, backend, device):
    """A mixed CPU/GPU group trains on the GPU (not silently on the CPU); NCCL groups are bound to
    the rank's GPU from the start (`device_id`)."""
    gpus(2)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("RANK", "1")
    calls, current = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: calls.append((b, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    calls.append(("already", {}))  # the caller's own group
    assert mesh.init_distributed("auto") == torch.device(device)
    assert calls == [("already", {})]
    calls.clear()
    if backend == "nccl":
        assert mesh.init_distributed("nccl", timeout_s=5) == torch.device(device)
        (b, kw), = calls
        assert b == "nccl" and kw["device_id"] == torch.device(device) and kw["timeout"].total_seconds() == 5
    assert current == ([torch.device(device)] * (2 if backend == "nccl" else 1) if device != "cpu" else [])


@pytest.mark.parametrize("message", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "DistBackendError: NCCL error: unhandled cuda error, NCCL version 2.27: Cuda failure 'out of memory'",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried",
    "killed by SIGKILL from the kernel's out-of-memory killer (host memory ran out)",
])
def test_out_of_memory_in_any_allocator_is_an_oom(message):
    assert is_oom(message)


def test_other_failures_are_errors():
    assert not is_oom("RuntimeError: injected failure on rank 1")
    assert not is_oom("killed by SIGKILL")
    assert not is_oom("RuntimeError: CUDA error: an illegal memory access was encountered")


def test_a_sigkill_is_the_oom_killer_only_when_the_kernel_counted_a_kill(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 100\noom_kill 4\npgfault 9\n")
    assert oom_kills(vmstat) == 4
    assert killed_by("SIGKILL", 4, vmstat) == "killed by SIGKILL"  # a kill -9: nothing counted
    assert is_oom(killed_by("SIGKILL", 3, vmstat))  # the OOM killer struck during the run
    assert killed_by("SIGSEGV", 3, vmstat) == "killed by SIGSEGV"
    assert oom_kills(tmp_path / "absent") is None and killed_by("SIGKILL", None, vmstat) == "killed by SIGKILL"


def test_fp16_with_offload_checks_overflow_on_the_cpu_over_a_gloo_group(monkeypatch):
    """The offloaded gradient shards are on the CPU: on a GPU world the scaler keeps its scale
    and overflow flag there and all-reduces them over a gloo group, not over NCCL."""
    from autopar.executor.precision import grad_scaler
    from autopar.plan import Plan

    groups = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: groups.append(kw) or "gloo world")
    p = Plan(dp=2, tp=1, pp=1, micro_batch_size=2, num_micro_batches=1, precision="fp16", zero=3,
             offload_optimizer=True)
    scaler = grad_scaler(p, torch.device("cuda", 0))
    assert groups == [{"backend": "gloo"}] and scaler.process_group == "gloo world"
    assert scaler._device == "cpu" and scaler.get_scale() == 2.0**16
    groups.clear()
    assert grad_scaler(p, torch.device("cpu")).process_group is dist.group.WORLD and groups == []
