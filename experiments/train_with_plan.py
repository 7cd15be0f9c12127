"""Your own training loop, parallelised by a plan: `autopar.apply` + your data and optimizer.

    autopar search gpt --model-arg size=tiny --cluster cpu --global-batch 16 -o plan.json
    torchrun --standalone --nproc-per-node 4 experiments/train_with_plan.py plan.json --steps 20

The plan decides everything parallel (mesh, tensor/pipeline/data parallel, ZeRO, recompute,
precision); the loop below is ordinary PyTorch. `--save DIR` writes a distributed checkpoint,
`--resume DIR` continues from one, also under a different plan (and world size).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import autopar
from autopar.executor import load_checkpoint, make_loader, save_checkpoint
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.zoo import counting_corpus

MODEL_ARGS = {"size": "tiny", "dropout": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", metavar="DIR", help="save a checkpoint here at the end")
    parser.add_argument("--resume", metavar="DIR", help="resume from this checkpoint")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="auto: NCCL when every rank on the node has a GPU, else gloo")
    args = parser.parse_args()

    plan = Plan.load(args.plan)
    gpt = load_model_file("gpt")  # any model.py works the same way
    par = autopar.apply(plan, lambda: gpt.build(**MODEL_ARGS), lambda params: torch.optim.AdamW(params, lr=args.lr),
                gpt.loss_fn, tp_plan=gpt.tp_plan, blocks=gpt.blocks, seed=0, backend=args.backend)

    # learnable synthetic text (each sequence counts up from a random token), so the loss falls;
    # read in order: step 1 is the dataset's first global batch, as in a single process
    tokens, targets = counting_corpus(4 * plan.global_batch, vocab=256, seq_len=32)  # the tiny GPT's sizes
    loader = make_loader(TensorDataset(tokens, targets), plan, par.topo)

    step = load_checkpoint(par, args.resume) if args.resume else 0
    while step < args.steps:
        for x, y in loader:
            loss = par.train_step(x.to(par.device), y.to(par.device))
            step += 1
            (mean,) = par.global_losses([loss])  # a collective: every rank calls it
            if dist.get_rank() == 0:
                print(f"step {step:3d}  loss {mean:.4f}", flush=True)
            if step == args.steps:
                break
    if args.save:
        save_checkpoint(par, args.save, step)
    dist.barrier()  # no rank closes its connections while a peer still uses them
    par.close()  # nothing refers to the process groups any more: destroying them joins their threads
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
