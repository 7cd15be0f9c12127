"""Whether a failed run ran out of memory: the messages and signals that say so.

A run that does not fit is an outcome ("oom"), not a crash: the measured reward scores it as
infeasible and traces record it. GPU memory runs out inside more than PyTorch's caching
allocator: cuBLAS and cuDNN allocate their own workspaces and report their own status codes,
and NCCL reports CUDA's error string. Host memory runs out as a `bad_alloc` / allocator error,
or as the kernel's OOM killer sending SIGKILL, which no message explains: the kernel's count of
OOM kills (/proc/vmstat `oom_kill`) rising during the run tells it from a `kill -9`.
"""

from __future__ import annotations

from pathlib import Path

OOM_MARKERS = (
    "OutOfMemoryError",  # torch.OutOfMemoryError (CUDA caching allocator)
    "out of memory",  # CUDA's error string (cudaErrorMemoryAllocation), NCCL's "Cuda failure 'out of memory'"
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace / handle
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN 8
    "ALLOCATION_FAILED",  # cuDNN 9: CUDNN_STATUS_INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED
    "DefaultCPUAllocator: can't allocate memory",  # host tensors
    "DefaultCPUAllocator: not enough memory",
    "std::bad_alloc",
    "MemoryError",  # Python's own
    "out-of-memory killer",  # see `killed_by`
)
VMSTAT = Path("/proc/vmstat")


def is_oom(message: str) -> bool:
    """Whether a rank's failure message says it ran out of GPU or host memory (any case)."""
    lowered = message.lower()
    return any(marker.lower() in lowered for marker in OOM_MARKERS)


def oom_kills(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of processes its OOM killer has killed, or None where unknown."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def killed_by(signal_name: str, kills_before: int | None, vmstat: Path = VMSTAT) -> str:
    """How a rank that died of `signal_name` is reported: a SIGKILL while the OOM killer's count
    rose names the OOM killer (a run killed that way ran out of host memory)."""
    after = oom_kills(vmstat)
    if signal_name == "SIGKILL" and kills_before is not None and after is not None and after > kills_before:
        return "killed by SIGKILL from the kernel's out-of-memory killer (host memory ran out)"
    return f"killed by {signal_name}"
