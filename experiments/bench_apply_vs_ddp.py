"""Overhead of `autopar.apply`: a DP-only plan against a hand-written DDP loop.

    torchrun --standalone --nproc-per-node 2 experiments/bench_apply_vs_ddp.py

Both train the same GPT (same weights, batch, AdamW, fp32, 25 MB gradient buckets) in one
session and one process group, alternating: run 1 of each, run 2 of each, ... Each run is
`--warmup` untimed steps and `--steps` timed ones; a run's figure is its median step time. The
result is the median over the run pairs of (autopar run / the DDP run right after it): pairing
adjacent runs cancels the drift of a shared machine (acceptance: <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autopar.executor import apply
from autopar.executor.weights import build_full_model
from autopar.modelfile import load_model_file
from autopar.plan import Plan

MODEL_ARGS = {"size": "tiny", "hidden": 128, "heads": 4, "layers": 4, "seq_len": 128, "vocab": 1024, "dropout": 0.0}
BUCKET_MB = 25.0


def timed(step, steps: int, warmup: int) -> float:
    """Median wall time of `steps` calls of `step` after `warmup` untimed ones (max over ranks)."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()

    gpt = load_model_file("gpt")
    build = lambda: gpt.build(**MODEL_ARGS)
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4)
    world = int(os.environ["WORLD_SIZE"])
    plan = Plan(dp=world, tp=1, pp=1, micro_batch_size=args.global_batch // world, num_micro_batches=1,
                precision="fp32", bucket_mb=BUCKET_MB)

    par = apply(plan, build, optimizer, gpt.loss_fn, blocks=gpt.blocks)  # initialises the process group
    ddp = DistributedDataParallel(build_full_model(build, seed=0), bucket_cap_mb=BUCKET_MB)
    ddp_opt = optimizer(list(ddp.parameters()))

    torch.manual_seed(0)
    inputs, targets = gpt.example_batch(args.global_batch, device="cpu", **MODEL_ARGS)
    x, y = par.local_batch(inputs, targets)

    def ddp_step():
        ddp_opt.zero_grad(set_to_none=True)
        gpt.loss_fn(ddp(*x), y).backward()
        ddp_opt.step()

    results = {"autopar.apply": [], "hand-written DDP": []}
    for _ in range(args.runs):
        results["autopar.apply"].append(timed(lambda: par.train_step(x, y), args.steps, args.warmup))
        results["hand-written DDP"].append(timed(ddp_step, args.steps, args.warmup))
    if dist.get_rank() == 0:
        for name, medians in results.items():
            print(f"{name:18s} median step per run (ms): " + " ".join(f"{m * 1e3:7.1f}" for m in medians))
        ratios = [a / d for a, d in zip(results["autopar.apply"], results["hand-written DDP"])]
        print("ratio per run pair: " + " ".join(f"{r:.3f}" for r in ratios))
        print(f"step-time ratio autopar.apply / DDP (median of {args.runs} pairs): {statistics.median(ratios):.3f}")
    par.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
