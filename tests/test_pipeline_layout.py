"""Pipelining and sequence parallelism for any layout (issue 38, point 2): the layout facts read from
the forward (autopar/layout.py), pipeline stages cut from its graph under the model's own names,
the stream's ends found without names, one-line refusals for a forward that cannot be cut; and
a GPT with its own top-level names (tests/models/gpt_own_names.py) estimated, run and resumed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.cli import main
from conftest import run_stages

from autopar.errors import PlanError
from autopar.executor.pipeline import cut_stages, held_blocks, rank_view
from autopar.executor.tensor_parallel import StreamScatter, tp_styles
from autopar.executor.tied import tied_names
from autopar.executor.weights import build_full_model
from autopar.layout import forward_layout
from autopar.modelfile import load_model_file
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
OWN = ROOT / "tests" / "models" / "gpt_own_names.py"
MODEL = load_model_file(OWN)
NAMES_PLAN = MODEL.module.NAMES_PLAN  # the model's plan as style names


def plan(**kw) -> Plan:
    base = {"dp": 1, "tp": 1, "pp": 2, "micro_batch_size": 1, "num_micro_batches": 2, "precision": "fp32"}
    return Plan(**{**base, **kw})


def own_gpt(tied: bool = False) -> nn.Module:
    model = build_full_model(lambda: MODEL.build(size="tiny", dropout=0.0), seed=0).eval()
    if tied:
        model.out.weight = model.tok.weight
    return model


def test_the_layout_comes_from_the_forward_not_the_names():
    model = own_gpt()
    layout = forward_layout(model, model.layers)
    assert layout.blocks == tuple(f"layers.{i}" for i in range(4))
    assert layout.first == ("tok", "pos", "drop") and layout.last == ("norm", "out")
    assert layout.input is None and layout.head == "out"  # tok + pos: no one module gives the stream
    assert layout.pp_problem is None and layout.sp_problem is None and not layout.skips_parts
    zoo = load_model_file("gpt").build(size="tiny")
    titan = forward_layout(zoo, zoo.layers)  # skips parts set to None: stages stay copies
    assert titan.skips_parts and titan.input == "tok_embeddings" and titan.last == ("norm", "output")


@pytest.mark.parametrize("kw", [{}, {"schedule": "interleaved", "virtual_stages": 2}])
def test_graph_stages_compute_the_model_under_its_own_names(kw):
    model = own_gpt()
    p = plan(**kw)
    by_stage = {s: part for rank in range(p.pp) for s, part in
                zip([rank + c * p.pp for c in range(p.virtual_stages)], cut_stages(model, model.layers, p, rank))}
    stages = [by_stage[s] for s in range(p.stages)]
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.allclose(run_stages(stages, tokens), model(tokens), atol=1e-6)
    names = [n for s in stages for n in s.state_dict()]
    assert sorted(names) == sorted(model.state_dict())  # every entry once, named as the model names it
    layout = forward_layout(model, model.layers)
    assert [k for s in stages for _, k in held_blocks(s, layout)] == ["0", "1", "2", "3"]
    view = rank_view([by_stage[0], by_stage[p.stages - 1]])  # what rank 0's optimizer and checkpoint see
    assert {n for n, _ in view.named_parameters()} == {n for s in (stages[0], stages[-1]) for n, _ in
                                                        s.named_parameters()}


def test_tied_weights_keep_their_names_on_the_first_and_last_stage():
    model = own_gpt(tied=True)
    first, = cut_stages(model, model.layers, plan(), 0)
    last, = cut_stages(model, model.layers, plan(), 1)
    assert tied_names(model) == [("tok.weight", "out.weight")]
    assert "tok.weight" in dict(first.named_parameters()) and "out.weight" in dict(last.named_parameters())
    assert torch.equal(first.get_parameter("tok.weight"), last.get_parameter("out.weight"))


REVISITS = '''
    def forward(self, idx):
        x = self.tok(idx)
        for block in self.layers:
            x = block(x)
        return x @ self.tok.weight.T
'''
BRANCHES = '''
    def forward(self, idx):
        x = self.tok(idx)
        if x.sum() > 0:
            x = -x
        for block in self.layers:
            x = block(x)
        return self.out(x)
'''
HANDS_A_MASK = '''
    def forward(self, idx):
        keep = (idx > 3).float()[..., None]
        x = self.tok(idx)
        for block in self.layers:
            x = block(x) * keep
        return self.out(x)
'''


@pytest.mark.parametrize("forward, why", [
    (REVISITS, "the forward uses tok.weight at more than one place in the stack of blocks (before the blocks, "
               "after layers.3)"),
    (BRANCHES, "branches on tensor values (data-dependent control flow)"),
    (HANDS_A_MASK, "the forward hands layers.1 the value 'getitem' computed before the blocks"),
])
def test_a_forward_that_cannot_be_cut_says_why_in_one_line(forward, why):
    scope = {}
    exec("def forward" + forward.split("def forward", 1)[1].replace("\n    ", "\n"), {}, scope)
    model = own_gpt()
    model.__class__ = type("Other", (type(model),), {"forward": scope["forward"]})
    reason = forward_layout(model, model.layers).pp_problem
    assert why in reason and "\n" not in reason and reason.endswith("use pp=1")
    with pytest.raises(PlanError, match="use pp=1$"):
        cut_stages(model, model.layers, plan(), 0)


def test_sequence_parallelism_finds_the_stream_without_names():
    model = own_gpt()
    styles = tp_styles(model, {k.replace("*", "0"): v for k, v in NAMES_PLAN.items()}, model.layers, True)
    assert isinstance(styles["layers.0"], StreamScatter)  # tok + pos run whole, the first block scatters
    assert styles["tok"].output_layouts[0].is_replicate()
    assert styles["out"].input_layouts[0].is_shard(1)  # the head gathers the sequence
    assert "norm" in styles and "layers.0.ln1" in styles


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_own_names_estimate_run_parity_and_resume_under_pp1(tmp_path, capsys):
    """Acceptance 2 of issue 38: estimate (both runtimes) accepts pp=2 and tp=2 with sequence parallelism;
    `autopar run` of pp=2 on 2 gloo ranks matches one process; one torchrun job: pp=2 trains and saves a DCP
    checkpoint, pp=1 dp=2 resumes it with the straight run's losses; tp=2 + SP with the model's ParallelStyles
    and with style names match one process."""
    common = [str(OWN), "--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "8",
              "--dp", "1", "--micro-batch-size", "2", "--precision", "fp32", "--json"]
    for runtime in ("torch", "megatron"):
        for degrees in (["--pp", "2"], ["--tp", "2", "--sequence-parallel"]):
            assert main(["estimate", *common, *degrees, "--runtime", runtime]) == 0, (runtime, degrees)
            estimate = json.loads(capsys.readouterr().out)
            assert estimate["iteration_time_s"] > 0 and estimate["plan"]["pp"] == (2 if "--pp" in degrees else 1)
    plan(micro_batch_size=2).save(tmp_path / "pp2.json")
    ran = subprocess.run([sys.executable, "-m", "autopar", "run", "pp2.json", str(OWN), "--model-arg", "size=tiny",
                          "--nproc-per-node", "2", "--backend", "gloo", "--steps", "2", "--warmup", "1",
                          "--check-parity", "--no-dropout", "--trace", "t.jsonl"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "matches one process" in ran.stdout
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(OWN.with_name("own_names_job.py")), str(tmp_path / "losses.json"), "gloo"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert job.returncode == 0, job.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    reference, tied = losses.pop("reference"), losses.pop("reference tied")
    expected = {"pp2": reference[:3], "pp1 dp2 resumed": reference[3:], "pp2 interleaved recompute": reference[:2],
                "tp2 sp styles": reference[:2], "tp2 sp names": reference[:2],
                "pp2 interleaved tied, embedding-only and head-only stages, per-stage recompute": tied,
                "pp2 zbv tied, embedding-only and head-only stages on rank 0, per-stage recompute": tied}
    assert set(losses) == set(expected)
    for case, values in losses.items():
        assert values == pytest.approx(expected[case], rel=1e-5), case
