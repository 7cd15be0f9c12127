"""tp_plan as torch ParallelStyle objects (torchtitan's form), the model capabilities the plan
space honours, and `autopar run` refusing in one line, before launch, what the executor cannot
do for a model. Fast, in-process."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from conftest import error_lines
from torch.distributed.tensor.parallel import ColwiseParallel

from autopar.capability import check_plan
from autopar.cli import main
from autopar.errors import ModelFileError, PlanError
from autopar.executor.parity import mismatch_causes, parity_verdict, without_dropout
from autopar.modelfile import load_model_file, resolve_tp_plan
from autopar.plan import Plan
from autopar.profile import profile_model

TITAN = str(Path(__file__).resolve().parent / "torchtitan_llama.py")
UNCUTTABLE = '''
import torch
from torch import nn

class Net(nn.Module):  # the embedding's weight is read again after the blocks, outside any module
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x @ self.embed.weight.T

def build_model():
    return Net()

def example_batch(batch_size):
    return torch.randint(0, 64, (batch_size, 8)), torch.randint(0, 64, (batch_size, 8))

def tp_plan(model):
    return {"layers.*": "colwise_rep"}
'''


def _search(model, capsys, *extra):
    assert main(["search", model, "--model-arg", "size=llama2-70b", "--nodes", "4", "--global-batch", "128",
                 "--method", "exhaustive", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_torchtitan_style_objects_plan_like_the_string_form(capsys):
    strings, objects = _search("llama", capsys), _search(TITAN, capsys)
    assert objects["plan"] == strings["plan"] and objects["plan"]["sequence_parallel"]
    assert objects["estimate"]["iteration_time_s"] == pytest.approx(strings["estimate"]["iteration_time_s"], rel=1e-9)
    assert "sp_off" in objects["workload"]["excluded"] and strings["workload"]["excluded"] == {}


def test_objects_decide_sequence_parallelism():
    profile = profile_model(TITAN, {"size": "tiny"}, dtype="fp32")
    plan = Plan(dp=2, tp=2, pp=1, micro_batch_size=4, num_micro_batches=1, precision="fp32")
    with pytest.raises(PlanError, match="shard the sequence"):
        check_plan(plan, profile)
    check_plan(plan.with_(sequence_parallel=True), profile)


def test_a_plan_mixes_no_forms_and_names_torch_styles_in_its_errors():
    model = load_model_file("llama").build(size="tiny")
    with pytest.raises(ModelFileError, match="mixes style names and ParallelStyle objects"):
        resolve_tp_plan(model, {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": ColwiseParallel()})
    with pytest.raises(ModelFileError, match="or a torch ParallelStyle such as ColwiseParallel"):
        resolve_tp_plan(model, {"layers.*.attention.wq": "packed"})
    resolved = resolve_tp_plan(model, {"layers.*.attention.wq": ColwiseParallel()})
    assert len(resolved) == 4 and all(isinstance(s, ColwiseParallel) for s in resolved.values())


@pytest.mark.slow
def test_the_space_leaves_out_what_the_layout_cannot_run_and_the_why_table_says_so(tmp_path, capsys):
    (tmp_path / "net.py").write_text(UNCUTTABLE)
    profile = profile_model(tmp_path / "net.py", {}, dtype="fp32", cache=False)
    assert "the forward uses embed.weight at more than one place" in profile.limits["pp"]
    assert "this forward has none after its blocks" in profile.limits["sp"]
    found = _search_small(tmp_path / "net.py", capsys)
    assert found["plan"]["pp"] == 1 and not found["plan"]["sequence_parallel"]
    why = {(r["knob"], r["instead"]) for r in found["why"]}
    assert any(k == "pp" and text.startswith("pp > 1 not considered: the forward uses embed.weight")
               for k, text in why)


def _search_small(model, capsys, method="exhaustive"):
    assert main(["search", str(model), "--cluster", "cpu", "--nodes", "1", "--gpus-per-node", "4",
                 "--global-batch", "8", "--precision", "fp32", "--method", method, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("method", ["rules", "exhaustive", "random"])
@pytest.mark.slow
def test_no_planner_proposes_what_the_layout_cannot_run(tmp_path, capsys, method):
    (tmp_path / "net.py").write_text(UNCUTTABLE)
    plan = _search_small(tmp_path / "net.py", capsys, method)["plan"]
    assert plan["pp"] == 1 and not plan["sequence_parallel"]


@pytest.mark.parametrize("plan, message", [
    (dict(dp=2, pp=2, num_micro_batches=2), "pp=2 but the forward uses embed.weight at more than one place"),
    (dict(dp=2, tp=2, sequence_parallel=True), "gathers the sequence into the module that computes the forward's"),
])
@pytest.mark.slow  # profiles net.py in its child process
def test_autopar_run_refuses_before_launch_in_one_line(tmp_path, capsys, plan, message):
    (tmp_path / "net.py").write_text(UNCUTTABLE)
    Plan(**{"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_micro_batches": 1, "precision": "fp32",
            **plan}).save(tmp_path / "p.json")
    code = main(["run", str(tmp_path / "p.json"), str(tmp_path / "net.py"), "--nproc-per-node", "4",
                 "--backend", "gloo", "--cluster", "cpu", "--trace", str(tmp_path / "t.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(error_lines(err)) == 1, err
    assert not (tmp_path / "t.jsonl").exists()


def test_estimate_uses_the_plans_precision(tmp_path, capsys):
    Plan(dp=4, tp=1, pp=1, micro_batch_size=2, num_micro_batches=1, precision="fp32").save(tmp_path / "p.json")
    args = ["estimate", "gpt", "--model-arg", "size=tiny", "--cluster", "cpu", "--plan", str(tmp_path / "p.json")]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["precision"] == "fp32"
    assert main([*args, "--precision", "bf16"]) == 2
    assert "--precision bf16 but the plan trains in fp32" in capsys.readouterr().err


def test_parity_names_what_explains_a_mismatch():
    gpt = load_model_file("gpt").build(size="tiny")  # dropout 0.1
    resnet = load_model_file("resnet").build(size="tiny")
    plan = Plan(dp=4, tp=1, pp=1, micro_batch_size=2, num_micro_batches=1, precision="bf16")
    assert [c.split(" ")[0] for c in mismatch_causes(gpt, plan)] == ["dropout", "bf16"]
    assert mismatch_causes(resnet, plan.with_(precision="fp32"))[0].startswith("BatchNorm normalises each micro-batch of 2")
    assert mismatch_causes(without_dropout(gpt), plan.with_(precision="fp32")) == []
    assert all(m.p == 0 for m in gpt.modules() if isinstance(m, nn.Dropout))
    assert parity_verdict(3e-7, []).startswith("matches one process")
    assert "dropout draws other random masks" in parity_verdict(4e-3, mismatch_causes(load_model_file("gpt").build(
        size="tiny"), plan))
    assert parity_verdict(4e-3, []).endswith("a bug")


def test_identical_initial_weights_on_every_build():
    from autopar.executor.weights import build_full_model

    def build():
        return load_model_file("llama").build(size="tiny")

    a, b = build_full_model(build, 0), build_full_model(build, 0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def spaces(tmp_path_factory):
    """(model, args, model file, plan space) for tiny zoo models and one HF model on 4 CPU ranks."""
    pytest.importorskip("transformers")
    from autopar.cluster import load_cluster
    from autopar.search.space import enumerate_plans
    from autopar.workload import Workload
    from hf_configs import write_configs

    qwen3 = write_configs(tmp_path_factory.mktemp("hf"))["qwen3"]
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=4)
    out = []
    for model, args in [("gpt", {"size": "tiny"}), ("llama", {"size": "tiny"}), ("vit", {"size": "tiny"}),
                        ("bert", {"size": "tiny"}), ("resnet", {"size": "tiny"}), (TITAN, {"size": "tiny"}),
                        (qwen3, {})]:
        workload = Workload(profile_model(model, args, dtype="fp32"), cluster, 8)
        out.append((load_model_file(model), args, workload, enumerate_plans(workload)))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_plan_of_the_space_passes_the_executors_checks(spaces, data):
    """Whatever a planner can return, `autopar run`'s pre-launch checks accept: the space holds no
    plan that run would refuse (the multi-rank job in test_hf_parity runs a sample of them)."""
    from autopar.executor.preflight import preflight

    model_file, args, workload, space = data.draw(st.sampled_from(spaces))
    plan = space.plan(data.draw(st.integers(0, len(space) - 1)))
    plan.validate(workload)
    preflight(plan, model_file, args)
