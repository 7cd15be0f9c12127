"""What torch.compile makes of torchao's float8 linears, as the cost model prices it (cost/precision.py,
cost/op_sac.py), read from the compiled graphs themselves on the CPU: no GPU, no kernel runs that matter.

- One cast per input, however many linears read it. torchtitan's Llama runs q, k and v (and w1, w3) as
  separate linears on one input; `precision._linears` counts the casts of the fused GEMM cost/gemm.py
  prices (one input). Each `Float8Linear` casts its own input, but AOTAutograd's common-subexpression pass
  merges the identical casts: the compiled forward takes the input's amax once and hands the three
  `_scaled_mm` one fp8 tensor.
- torchtitan's per-op selective checkpoint reruns the same matmuls in fp8 as in bf16. Its save list names
  `aten.mm` (every second one recomputed) and not `aten._scaled_mm`, which float8 GEMMs lower to; the policy
  still counts them, as it sees the float8 tensor's `aten.mm` before torchao dispatches it, so one of a
  gated MLP's three GEMMs reruns in either precision (`op_sac.recomputed_flops`: every second matmul).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from autopar.cost.op_sac import _forward_mms  # noqa: E402


def _graphs(module: nn.Module, x: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd hands a compiler (with the min-cut partitioner Inductor
    uses, and its common-subexpression pass), after one compiled forward and backward."""
    seen: dict[str, torch.fx.GraphModule] = {}

    def keep(name):
        def compiler(gm, _inputs):
            seen[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(x).sum().backward()
    return seen


def _calls(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


class _QKV(nn.Module):
    """q, k and v as torchtitan's Attention runs them: three linears on one input (grouped k and v)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(256, n, bias=False) for n in (256, 64, 64))

    def forward(self, x):
        return self.wq(x).sum() + self.wk(x).sum() + self.wv(x).sum()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compile_casts_an_input_once_for_the_linears_that_read_it(recipe):
    m = _QKV()
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    forward = _graphs(m, torch.randn(128, 256, requires_grad=True))["forward"]
    mms = [n for n in forward.graph.nodes if n.target == torch.ops.aten._scaled_mm.default]
    assert len(mms) == 3
    assert len({n.args[0] for n in mms}) == 1  # one fp8 input for q, k and v
    x = next(n for n in forward.graph.nodes if n.op == "placeholder" and n.meta["val"].shape == (128, 256))
    amax = [n for n in forward.graph.nodes if n.target == torch.ops.aten.abs.default and n.args[0] is x]
    assert len(amax) == 1, [str(n) for n in amax]  # its amax taken once, not once per linear


def _op_sac_context():
    """torchtitan's per-op selective checkpoint policy as its llama3 `parallelize_llama.py` wrote it when the
    published torch-native rows ran (commit 820504e: `_save_list` and `_custom_policy`)."""
    save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten.max.default}
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        to_save = func in save and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _MLP(nn.Module):
    """torchtitan's FeedForward (w2(silu(w1 x) * w3 x)) under its per-op selective checkpoint."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(256, 512, bias=False), nn.Linear(256, 512, bias=False)
        self.w2 = nn.Linear(512, 256, bias=False)

    def inner(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=_op_sac_context)


@pytest.mark.parametrize("precision", ["bf16", "tensorwise", "rowwise"])
def test_op_sac_reruns_every_second_matmul_in_fp8_as_in_bf16(precision):
    m = _MLP()
    gemm = torch.ops.aten.mm.default
    if precision != "bf16":
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(precision))
        gemm = torch.ops.aten._scaled_mm.default
    graphs = _graphs(m, torch.randn(128, 256, requires_grad=True))
    forward, backward = (_calls(graphs[k])[str(gemm)] for k in ("forward", "backward"))
    # the cost model's count: a gated MLP's matmuls in torchtitan's order (w1, w3, w2), every second rerun
    dims = {"hidden": 256, "heads": 1, "ffn": 512}
    block = SimpleNamespace(experts=0, params=4 * 256 * 256 + 3 * 256 * 512)  # attention's four and the MLP's three
    mlp = _forward_mms(dims, 1, block)[4:]
    assert len(mlp) == forward == 3
    assert backward == 2 * forward + len(mlp[1::2])  # input and weight gradients, and the one rerun
