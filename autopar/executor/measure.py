"""What a run measures: step times, peak memory, throughput."""

from __future__ import annotations

import resource
import statistics
import sys

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a step's wall time is its real time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA `max_memory_allocated` on a GPU; on the CPU the process's RSS high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024)


def tokens_per_sample(inputs: tuple[torch.Tensor, ...]) -> int:
    """The sequence length when the first input is a (batch, seq) tensor of token ids, else 1
    (throughput is then counted in samples)."""
    first = inputs[0]
    if first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return 1


def summarize(step_times: list[list[float]], peaks: list[int], global_batch: int, seq_len: int) -> dict:
    """The `measured` part of a trace record from every rank's timed steps and peak memory.

    A step lasts as long as its slowest rank, so each step's time is the maximum over ranks.
    """
    per_step = [max(times) for times in zip(*step_times)]
    median = statistics.median(per_step) if per_step else float("nan")
    return {"step_times_s": per_step, "median_step_s": median,
            "tokens_per_s": global_batch * seq_len / median if per_step else 0.0,
            "peak_memory_bytes": peaks}
