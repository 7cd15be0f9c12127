"""Launched by torchrun from tests/test_context_parallel.py (4 gloo ranks): each context-parallel
case of CASES applied with `autopar.executor.train_step.apply`, trained STEPS steps on the zoo
model's batch on the backend given second; rank 0 writes {case: global losses} to the JSON file given first."""

import json
import sys
from functools import partial

import torch
import torch.distributed as dist

from autopar.executor.mesh import release_meshes
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan

STEPS = 3
GLOBAL_BATCH = 8
MODEL_ARGS = {"gpt": {"size": "tiny", "dropout": 0.0}, "llama": {"size": "tiny"}}


def plan(dp=1, tp=1, cp=1, **kw) -> Plan:
    return Plan(dp=dp, tp=tp, cp=cp, pp=1, micro_batch_size=GLOBAL_BATCH // dp, num_micro_batches=1,
                precision="fp32", **kw)


CASES = {f"{model} {name}": (model, p) for model in MODEL_ARGS
         for name, p in (("cp2 dp2", plan(dp=2, cp=2)), ("cp2 tp2", plan(tp=2, cp=2)))}
CASES["gpt cp2 dp2 zero3, 2 micro-batches"] = ("gpt", Plan(dp=2, cp=2, pp=1, tp=1, micro_batch_size=2,
                                                          num_micro_batches=2, zero=3, precision="fp32"))


def batch(model: str):
    torch.manual_seed(1000)
    return load_model_file(model).example_batch(GLOBAL_BATCH, device="cpu", **MODEL_ARGS[model])


def sgd(params):
    return torch.optim.SGD(params, lr=2.0)  # plain SGD: a wrong gradient scale shows in the losses


def main(out: str, backend: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, (model, p) in CASES.items():
        mf = load_model_file(model)
        par = apply(p, partial(mf.build, **MODEL_ARGS[model]), sgd, mf.loss_fn, tp_plan=mf.tp_plan, blocks=mf.blocks,
                    backend=backend)
        local = par.local_batch(*batch(model))
        results[name] = par.global_losses([par.train_step(*local) for _ in range(STEPS)])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    release_meshes()  # the plans' models and meshes: destroying the groups then joins their threads
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # the backend: the test pins gloo
