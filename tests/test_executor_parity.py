"""Acceptance 1: on gloo with 4 processes, fp32, every plan's per-step global-batch losses equal
a single-process run of the same model, data and seed (relative 1e-5): the acceptance list on
the bundled tiny GPT, plus other knobs and the Llama and ViT layouts; and a DCP checkpoint
saved under one plan resumes under another with the losses of an uninterrupted run.

One 4-rank job (torch.multiprocessing) runs every collected case in turn (`-k` picks some) and
writes the losses to JSON; the tests compare them with the plain single-process loop.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import collected, free_port, is_collected

from autopar.executor import weights
from autopar.executor.mesh import release_meshes
from autopar.executor.parity import max_relative_difference, reference_losses
from autopar.executor.state import load_checkpoint, save_checkpoint
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan

WORLD = 4
STEPS = 3
GLOBAL_BATCH = 16
MODEL_ARGS = {"gpt": {"size": "tiny", "dropout": 0.0}, "llama": {"size": "tiny"},
              "vit": {"size": "tiny", "dropout": 0.0}}


def _plan(dp=1, tp=1, pp=1, n=1, **kw) -> dict:
    mb = GLOBAL_BATCH // (dp * n)
    return Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mb, num_micro_batches=n, precision="fp32", **kw).to_dict()


# name -> (zoo model, plan); the acceptance list first, all on the bundled GPT
CASES = {
    "dp4": ("gpt", _plan(dp=4)),
    "tp2 dp2": ("gpt", _plan(dp=2, tp=2)),
    "pp2 dp2 1f1b": ("gpt", _plan(dp=2, pp=2, n=4, schedule="1f1b")),
    "pp2 tp2": ("gpt", _plan(tp=2, pp=2, n=4)),
    "tp2 dp2 sequence parallel": ("gpt", _plan(dp=2, tp=2, sequence_parallel=True)),
    "zero1 dp4": ("gpt", _plan(dp=4, zero=1)),
    "zero3 fsdp2 dp4": ("gpt", _plan(dp=4, zero=3)),
    "hsdp 2x2 zero3 dp4": ("gpt", _plan(dp=4, zero=3, dp_replicate=2)),
    "recompute all blocks dp4": ("gpt", _plan(dp=4, recompute="full", recompute_blocks=4)),
    "bucket 1 MB dp4": ("gpt", _plan(dp=4, bucket_mb=1)),
    "bucket 100 MB dp4": ("gpt", _plan(dp=4, bucket_mb=100)),
    "interleaved pp2 v2 dp2": ("gpt", _plan(dp=2, pp=2, n=4, schedule="interleaved", virtual_stages=2)),
    "4 micro-batches dp4": ("gpt", _plan(dp=4, n=4)),
    # beyond the acceptance list: the other knobs, their combinations, other layouts
    "selective recompute tp2 sp dp2": ("gpt", _plan(dp=2, tp=2, sequence_parallel=True, recompute="selective")),
    "zero2 dp4": ("gpt", _plan(dp=4, zero=2)),
    "zero3 tp2 dp2": ("gpt", _plan(dp=2, tp=2, zero=3)),
    "zero3 pp2 dp2": ("gpt", _plan(dp=2, pp=2, n=4, zero=3)),
    "interleaved pp2 v2 dp2 zero3": ("gpt", _plan(dp=2, pp=2, n=4, schedule="interleaved", virtual_stages=2, zero=3)),
    "gpipe pp2 dp2": ("gpt", _plan(dp=2, pp=2, n=2, schedule="gpipe")),
    "pp2 dp2 zero1 uneven split, pp innermost": ("gpt", _plan(dp=2, pp=2, n=2, zero=1, layer_split=(1, 3),
                                                              mesh_order=("dp", "tp", "pp"))),
    "llama (GQA, RMSNorm) pp2 tp2 sp": ("llama", _plan(tp=2, pp=2, n=2, sequence_parallel=True)),
    "vit (patch input, classifier head) tp2 dp2 sp": ("vit", _plan(dp=2, tp=2, sequence_parallel=True)),
}
# (saved under, resumed under): checkpoint hot migration, AdamW state included
MIGRATIONS = [("dp4", "pp2 tp2"), ("tp2 dp2", "interleaved pp2 v2 dp2"), ("zero3 fsdp2 dp4", "zero1 dp4"),
              ("pp2 dp2 1f1b", "tp2 dp2 sequence parallel"), ("interleaved pp2 v2 dp2 zero3", "dp4"),
              ("hsdp 2x2 zero3 dp4", "zero1 dp4")]


def sgd(params):
    return torch.optim.SGD(params, lr=2.0)  # plain SGD: wrong gradient scaling shows in the losses


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


class Zoo:
    """A zoo model with its tiny arguments, a fixed global batch, and `apply` of a plan to it."""

    def __init__(self, name: str):
        self.file, self.args = load_model_file(name), MODEL_ARGS[name]
        torch.manual_seed(1000)
        self.batch = self.file.example_batch(GLOBAL_BATCH, device="cpu", **self.args)

    def build(self):
        return self.file.build(**self.args)

    def apply(self, plan: dict, optimizer, seed=0):
        return apply(Plan.from_dict(plan), self.build, optimizer, self.file.loss_fn, tp_plan=self.file.tp_plan,
                     blocks=self.file.blocks, seed=seed, backend="gloo")  # several ranks: never NCCL

    def train(self, par, steps):
        local = par.local_batch(*self.batch)
        return par.global_losses([par.train_step(*local) for _ in range(steps)])

    def reference(self, optimizer, steps):
        return reference_losses(self.build, optimizer, self.file.loss_fn, [self.batch] * steps)


def _worker(rank: int, port: int, out: str, names: list, migrations: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    whole = []  # the whole models this rank built (initialised, in host RAM)
    build_whole = weights.build_full_model
    weights.build_full_model = lambda *a, **kw: whole.append(1) or build_whole(*a, **kw)
    zoo = {name: Zoo(name) for name in MODEL_ARGS}
    results = {}
    for name in names:
        model, plan = CASES[name]
        results[name] = zoo[model].train(zoo[model].apply(plan, sgd), STEPS)
    gpt = zoo["gpt"]
    for i, (before, after) in enumerate(migrations):
        par = gpt.apply(CASES[before][1], adamw)
        first = gpt.train(par, 2)
        save_checkpoint(par, f"{out}.ckpt{i}", step=2)
        resumed = gpt.apply(CASES[after][1], adamw, seed=123)  # other initial weights: the checkpoint must win
        step = load_checkpoint(resumed, f"{out}.ckpt{i}")
        results[f"{before} -> {after}"] = first + gpt.train(resumed, 1) + [step]
    results["whole models built"] = [None] * WORLD
    dist.all_gather_object(results["whole models built"], len(whole))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    release_meshes()  # the plans' models and meshes: destroying the groups then joins their threads
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def losses(request, tmp_path_factory):
    """The losses of the collected cases and migrations (one case at least where the whole-model test runs)."""
    out = str(tmp_path_factory.mktemp("parity") / "losses.json")
    names = collected(request, "test_plan_losses_equal_single_process", "name")
    migrations = collected(request, "test_checkpoint_resumes_under_another_plan", "before", "after")
    if not names and not migrations and is_collected(request, "test_only_rank_0_ever_holds_the_whole_model"):
        names = list(CASES)[:1]
    mp.spawn(_worker, args=(free_port(), out, names, migrations), nprocs=WORLD)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference():
    zoo = {name: Zoo(name) for name in MODEL_ARGS}
    return {**{name: z.reference(sgd, STEPS) for name, z in zoo.items()}, "gpt adamw": zoo["gpt"].reference(adamw, 3)}


def test_reference_learns(reference):
    assert reference["gpt"][-1] < reference["gpt"][0] - 0.1  # the comparison is not of flat curves


@pytest.mark.slow
@pytest.mark.procs
def test_only_rank_0_ever_holds_the_whole_model(losses):
    """The other ranks lay the plan out on a meta-device skeleton and receive their shards from
    rank 0 (the parity tests show: with the same weights)."""
    applies = sum(name in losses for name in CASES) + 2 * sum(f"{b} -> {a}" in losses for b, a in MIGRATIONS)
    assert applies and losses["whole models built"] == [applies, 0, 0, 0]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
@pytest.mark.procs
def test_plan_losses_equal_single_process(losses, reference, name):
    expected = reference[CASES[name][0]]
    assert max_relative_difference(losses[name], expected) < 1e-5, (losses[name], expected)


@pytest.mark.parametrize("before,after", MIGRATIONS)
@pytest.mark.slow
@pytest.mark.procs
def test_checkpoint_resumes_under_another_plan(losses, reference, before, after):
    *curve, step = losses[f"{before} -> {after}"]
    assert step == 2
    assert max_relative_difference(curve, reference["gpt adamw"]) < 1e-5, (curve, reference["gpt adamw"])
