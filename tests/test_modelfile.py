"""The model.py loader: the contract, argument filtering, and one clear error per bad input."""

import textwrap

import pytest
from autopar.errors import AutoparError, ModelFileError
from autopar.modelfile import TP_STYLES, call_with_model_args, load_model_file, materialize

GOOD = """
import torch
from torch import nn

def build_model(width=8):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))

def example_batch(batch_size, width=8):
    return torch.randn(batch_size, width), torch.randint(0, 2, (batch_size,))
"""


def write(tmp_path, source, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def error_of(path, call=lambda mf: None) -> str:
    with pytest.raises(ModelFileError) as info:
        call(load_model_file(path))
    message = str(info.value)
    assert "\n" not in message  # the CLI prints it as one line
    return message


def test_good_model_builds_on_meta_and_filters_unknown_args(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD))
    model = mf.build(width=4, seq_len=128)  # seq_len is not a parameter of build_model: dropped
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model[0].in_features == 4
    inputs, targets = mf.example_batch(3, width=4, seq_len=128)
    assert isinstance(inputs, tuple) and inputs[0].shape == (3, 4) and targets.shape == (3,)
    assert mf.loss_fn(model(*inputs), targets).shape == ()
    assert mf.blocks(model) is None and mf.tp_plan(model) == {} and not mf.has_tp_plan
    assert len(mf.digest) == 64


def test_minimal_model_file_without_arguments(tmp_path):
    mf = load_model_file(write(tmp_path, """
        import torch
        from torch import nn
        def build_model():
            return nn.Linear(3, 3)
        def example_batch(batch_size):
            return {"inputs": torch.randn(batch_size, 3), "targets": torch.randint(0, 3, (batch_size,))}
    """))
    mf.build(size="ignored", seq_len=4)
    (x,), y = mf.example_batch(2, device="cpu", seq_len=4)
    assert x.device.type == "cpu" and y.shape == (2,)


def test_call_with_model_args_passes_everything_to_kwargs():
    assert call_with_model_args(lambda **kw: kw, a=1, b=2) == {"a": 1, "b": 2}
    assert call_with_model_args(lambda a=0: a, a=1, b=2) == 1


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = load_model_file(write(tmp_path / "a", GOOD))
    second = load_model_file(write(tmp_path / "b", GOOD.replace("width=8", "width=5")))
    assert first.module is not second.module
    assert first.build()[0].in_features == 8 and second.build()[0].in_features == 5
    assert first.digest != second.digest


def test_zoo_model_by_name():
    mf = load_model_file("gpt")
    assert mf.path.name == "gpt.py" and mf.has_tp_plan


def test_default_blocks_are_the_longest_module_list(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD + """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.short = nn.ModuleList([nn.Linear(8, 8)])
        self.long = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

def build_model():
    return Net()
"""))
    model = mf.build()
    assert mf.blocks(model) is model.long


def test_tp_plan_wildcards_expand_per_name_component():
    mf = load_model_file("gpt")
    plan = mf.tp_plan(mf.build(size="tiny"))
    assert [name for name in plan if name.endswith("wqkv")] == [f"layers.{i}.attention.wqkv" for i in range(4)]
    assert plan["output"] == "vocab" and plan["layers.3.feed_forward.w2"] == "rowwise"


def test_materialize_initialises_a_meta_model(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD))
    model = materialize(mf.build(), "cpu")
    assert model[0].weight.device.type == "cpu" and model[0].weight.abs().sum() > 0


@pytest.mark.parametrize("source, expected", [
    ("def build_model(:\n    pass\n", ["model.py:1", "syntax error"]),
    ("import torch\nx = 1 / 0\n", ["model.py:2", "importing the model file raised ZeroDivisionError"]),
    ("def example_batch(b):\n    return None\n", ["no function build_model()", "define build_model"]),
    ("from torch import nn\ndef build_model():\n    return nn.Linear(2, 2)\n",
     ["no function example_batch()"]),
])
def test_broken_files(tmp_path, source, expected):
    message = error_of(write(tmp_path, source))
    for part in expected:
        assert part in message


def test_missing_file_and_wrong_suffix(tmp_path):
    assert "no such model file" in error_of(tmp_path / "nope.py")
    assert "ending in .py" in error_of(write(tmp_path, GOOD, name="model.txt"))


@pytest.mark.parametrize("body, expected", [
    ("raise ValueError('bad width')", ["build_model() raised", "ValueError: bad width", "model.py:"]),
    ("return 3", ["returned int, not a torch.nn.Module"]),
    ("return nn.Linear(2, 2).to('cpu')", ["cannot run on the meta device", "NotImplementedError"]),
    ("m = nn.Linear(2, 2); m.register_buffer('table', torch.ones(3, device='cpu')); return m",
     ["off the meta device", "table (cpu)"]),
    ("m = nn.Linear(2, 2); m.weight.sum().item(); return m", ["cannot run on the meta device"]),
])
def test_models_that_cannot_be_built(tmp_path, body, expected):
    source = GOOD.replace("def build_model(width=8):\n    return", f"def build_model(width=8):\n    {body}\n    return")
    message = error_of(write(tmp_path, source), lambda mf: mf.build())
    for part in expected:
        assert part in message


@pytest.mark.parametrize("ret, expected", [
    ("torch.randn(batch_size, 8)", "returned Tensor"),
    ("(torch.randn(batch_size, 8), 3)", "must be tensors"),
    ("(torch.randn(2, 8), torch.zeros(2))", "dimension 0 of every input and target the batch size 5"),
    ("1 / 0", "example_batch(5) raised (ZeroDivisionError"),
])
def test_bad_example_batches(tmp_path, ret, expected):
    source = GOOD.replace("return torch.randn(batch_size, width), torch.randint(0, 2, (batch_size,))",
                          f"return {ret}")
    assert expected in error_of(write(tmp_path, source), lambda mf: mf.example_batch(5))


@pytest.mark.parametrize("plan, expected", [
    ("{'0': 'diagonal'}", "style 'diagonal'"),
    ("{'layers.*.wq': 'colwise'}", "matches no module"),
    ("{'1': 'colwise'}", "a ReLU"),
    ("[]", "returned list"),
])
def test_bad_tp_plans(tmp_path, plan, expected):
    source = GOOD + f"\ndef tp_plan(model):\n    return {plan}\n"
    assert expected in error_of(write(tmp_path, source), lambda mf: mf.tp_plan(mf.build()))


def test_bad_blocks(tmp_path):
    source = GOOD + "\ndef blocks(model):\n    return [model[0]]\n"
    assert "nn.ModuleList" in error_of(write(tmp_path, source), lambda mf: mf.blocks(mf.build()))


def test_styles_are_documented_and_errors_are_autopar_errors():
    assert set(TP_STYLES) == {"colwise", "rowwise", "colwise_rep", "rowwise_in", "vocab", "head_norm"}
    assert issubclass(ModelFileError, AutoparError)
