"""Launched by torchrun from tests/test_pipeline_layout.py (2 gloo ranks) on tests/models/gpt_own_names.py,
a GPT whose forward needs every part it has (tok, pos, layers, norm, out): a pp=2 plan (stages cut
from the forward's graph) trains STEPS steps and saves a DCP checkpoint; a pp=1 dp=2 plan loads
it and trains on; an interleaved pp=2 plan recomputes a block; one with tied embeddings, an
embedding-only first and a head-only last stage recomputes per stage, under interleaving and under
ZB-V (both ends on rank 0); tp=2 with sequence parallelism
runs the model's ParallelStyle plan and a plan of style names (the stream's ends read from the
forward). Rank 0 writes {case: global losses} to the JSON file given first, and the one-process
reference's losses under "reference"."""

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.executor.mesh import release_meshes
from autopar.executor.parity import reference_losses, without_dropout
from autopar.executor.state import load_checkpoint, save_checkpoint
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan

STEPS, MORE, GLOBAL_BATCH = 3, 2, 4
ARGS = {"size": "tiny"}
MODEL = load_model_file(Path(__file__).with_name("gpt_own_names.py"))


def build():
    return without_dropout(MODEL.build(**ARGS))


class TiedGPT(MODEL.module.GPT):
    """The GPT with tied input and output embeddings, re-tied after initialisation (`to_empty` gives
    every module its own new tensors), as autopar/hf.py's models do."""

    def init_weights(self):
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        self.out.weight = self.tok.weight


def build_tied():
    model = without_dropout(TiedGPT(MODEL.module.zoo_gpt.config(**ARGS)))
    model.out.weight = model.tok.weight
    return model


def batches(n: int):
    torch.manual_seed(1000)
    return [MODEL.example_batch(GLOBAL_BATCH, device="cpu", **ARGS) for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=2.0)  # plain SGD: a wrong gradient scale shows in the losses


def plan(**kw) -> Plan:
    base = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_micro_batches": 2, "precision": "fp32"}
    return Plan(**{**base, **kw})


def train(p: Plan, steps, tp_plan=None, resume=None, save=None, model=build) -> list[float]:
    par = apply(p, model, sgd, MODEL.loss_fn, tp_plan=tp_plan or MODEL.tp_plan, blocks=MODEL.blocks,
                backend=sys.argv[2])
    if resume:
        load_checkpoint(par, resume)
    losses = par.global_losses([par.train_step(*par.local_batch(*b)) for b in steps])
    if save:
        save_checkpoint(par, save, len(steps))
    par.close()
    return losses


def main(out: str) -> None:
    torch.set_num_threads(1)
    data = batches(STEPS + MORE)
    ckpt = Path(out).with_name("ckpt")
    results = {"pp2": train(plan(pp=2), data[:STEPS], save=ckpt),
               "pp1 dp2 resumed": train(plan(dp=2, micro_batch_size=1), data[STEPS:], resume=ckpt),
               "pp2 interleaved recompute": train(plan(pp=2, schedule="interleaved", virtual_stages=2,
                                                       recompute="full", recompute_blocks=1), data[:MORE]),
               "pp2 interleaved tied, embedding-only and head-only stages, per-stage recompute": train(
                   plan(pp=2, schedule="interleaved", virtual_stages=2, layer_split=(0, 2, 2, 0),
                        stage_recompute=("none", "full:1", "selective", "none")), data[:MORE], model=build_tied),
               # zero-bubble ZB-V (issue 41): rank 0 holds the embedding-only and the head-only stage, both tied copies
               "pp2 zbv tied, embedding-only and head-only stages on rank 0, per-stage recompute": train(
                   plan(pp=2, schedule="zbv", virtual_stages=2, layer_split=(0, 2, 2, 0),
                        stage_recompute=("none", "full:1", "full:2", "none")), data[:MORE], model=build_tied),
               "tp2 sp styles": train(plan(tp=2, sequence_parallel=True), data[:MORE]),
               "tp2 sp names": train(plan(tp=2, sequence_parallel=True), data[:MORE], tp_plan=MODEL.module.NAMES_PLAN)}
    if dist.get_rank() == 0:
        results["reference"] = reference_losses(build, sgd, MODEL.loss_fn, data)
        results["reference tied"] = reference_losses(build_tied, sgd, MODEL.loss_fn, data[:MORE])
        Path(out).write_text(json.dumps(results))
    release_meshes()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])  # the backend second: the test pins gloo
