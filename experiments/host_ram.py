"""Host RAM per rank of `apply`: peak resident memory (VmHWM) of 4 gloo ranks applying a plan.

    python experiments/host_ram.py                                # GPT-2 small, three plans
    python experiments/host_ram.py --model-arg size=gpt2-medium --plans "dp4 zero3"

One JSON line per plan: each rank's peak RSS after importing torch and after `apply`, the
growth between them, and the bytes of parameters it holds. Rank 0 builds the whole model (it
broadcasts the weights), the other ranks only their shards (`autopar.executor.weights`), so a
sharded plan (ZeRO-3, tp x pp) grows them by their share, a replicated one (DDP) by the whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan

WORLD = 4
PLANS = {"dp4 zero3": {"dp": 4, "zero": 3}, "tp2 pp2": {"tp": 2, "pp": 2, "num_micro_batches": 2},
         "dp4 zero0": {"dp": 4}}


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM), MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _rank(rank: int, port: int, model_args: dict, name: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    gpt = load_model_file("gpt")
    before = peak_rss_mb()
    p = Plan(**{"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_micro_batches": 1, "precision": "fp32", **PLANS[name]})
    par = apply(p, lambda: gpt.build(**model_args), torch.optim.SGD, gpt.loss_fn, tp_plan=gpt.tp_plan,
                blocks=gpt.blocks, backend="gloo")
    held = sum((q.to_local() if hasattr(q, "to_local") else q).nbytes for q in par.model.parameters())
    row = {"rank": rank, "peak_rss_before_MiB": round(before), "peak_rss_after_apply_MiB": round(peak_rss_mb()),
           "params_held_MiB": round(held / 2**20)}
    row["growth_MiB"] = row["peak_rss_after_apply_MiB"] - row["peak_rss_before_MiB"]
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(json.dumps({"plan": name, "model": model_args, "ranks": rows}), flush=True)
    par.close()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-arg", action="append", default=["size=gpt2-small"], metavar="KEY=VALUE")
    parser.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=list(PLANS))
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args(argv)
    model_args = dict(a.split("=", 1) for a in args.model_arg)
    for i, name in enumerate(args.plans):
        mp.spawn(_rank, args=(args.port + i, model_args, name), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
