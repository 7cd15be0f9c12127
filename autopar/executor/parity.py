"""The single-process reference that every plan's losses must reproduce.

Same seed, same initial weights, same global batches, one process, no parallelism, and the
plan's own device and precision (autocast, and fp16's loss scaling): a parallel plan that is
correct gives the same per-step global-batch losses up to the rounding of its precision. The
reference runs after the plan's process group is gone, so no peer waits on it in a collective.

`TOLERANCES` bound the largest relative loss difference of a correct plan. On 4 gloo ranks
over 3 steps of the tiny GPT (tests/test_executor_plans.py, 43 plans covering the space) the
largest seen were 1.8e-7 (fp32: only the order of reductions differs), 3.6e-6 (fp16, 11-bit
mantissa) and 3.0e-5 (bf16, 8-bit): sharded and split matmuls round differently from the single
process. The bounds leave about 10x room for other devices and models; a wrong gradient
(a missing reduction, a double scaling) moves the losses by 1e-3 to 1e-2.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from autopar.executor.precision import autocast, loss_scaler
from autopar.executor.train_step import move_targets
from autopar.executor.weights import build_full_model
from autopar.plan import Plan

TOLERANCES = {"fp32": 1e-5, "bf16": 3e-4, "fp16": 4e-5,
              "fp8": 5e-2}  # against the bf16 loop: e4m3 keeps 3 mantissa bits (not measured: no GPU in CI)
PARITY_TOLERANCE = TOLERANCES["fp32"]  # fp32: float rounding in another reduction order stays well below this


def deterministic() -> None:
    """Settings under which a rerun computes the same bits: no TF32 in fp32 matmuls and cuDNN
    convolutions (cuDNN convolutions default to TF32), deterministic kernels where PyTorch has
    them (a warning where it has none), and cuBLAS's fixed workspace (read when cuBLAS starts,
    so call this before the first CUDA matmul)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def reference_losses(build_model, optimizer, loss_fn, batches, seed: int = 0, *, precision: str = "fp32",
                     device: torch.device | str = "cpu") -> list[float]:
    """Per-step losses of a plain training loop over `batches` ((inputs tuple, targets) pairs),
    on `device` in `precision`."""
    device = torch.device(device)
    # fp8: the reference is the bf16 loop (its GEMM inputs unrounded to fp8): TOLERANCES["fp8"] allows for it
    plan = Plan(dp=1, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, precision=precision,
                fp8_recipe="tensorwise" if precision == "fp8" else "none")
    model = build_full_model(build_model, seed).to(device)
    opt = optimizer(list(model.parameters()))
    scaler = loss_scaler(plan, device)
    losses = []
    for inputs, targets in batches:
        inputs, targets = tuple(t.to(device) for t in inputs), move_targets(targets, device)
        opt.zero_grad(set_to_none=True)
        with autocast(plan, device):
            loss = loss_fn(model(*inputs), targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True)), default=0.0)


def without_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every dropout off: nn.Dropout modules and the float dropout rates modules keep
    for functional dropout (transformers' ``attention_dropout``, ``dropout``)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in ("dropout", "attention_dropout", "attn_dropout", "dropout_p"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


def mismatch_causes(model: nn.Module, plan) -> list[str]:
    """What makes a correct plan's losses differ from one process beyond float rounding."""
    causes = []
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        causes.append("dropout draws other random masks on other ranks (rerun with --no-dropout)")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) and \
            plan.dp * plan.num_micro_batches > 1:
        causes.append(f"BatchNorm normalises each micro-batch of {plan.micro_batch_size} with its own statistics, "
                      f"one process the global batch of {plan.global_batch}")
    if plan.precision != "fp32":
        causes.append(f"{plan.precision} rounds sums in another order on every plan (compare in fp32)")
    return causes


def parity_verdict(difference: float, causes: list[str], precision: str = "fp32") -> str:
    """One line: within the precision's tolerance, or the difference and its likely causes."""
    tolerance = TOLERANCES[precision]
    if difference <= tolerance:
        return f"matches one process (max rel. diff {difference:.1e} <= {tolerance:.0e})"
    why = "; ".join(causes) if causes else "no dropout, BatchNorm or low precision explains it: a bug"
    return f"differs from one process by {difference:.1e} (> {tolerance:.0e}): {why}"


def parity_report(losses: list[float], reference: list[float], precision: str, device: torch.device) -> dict:
    """What `--check-parity` records: the difference, the tolerance for the precision, the verdict."""
    diff = max_relative_difference(losses, reference)
    return {"parity_max_rel_diff": diff, "parity_tolerance": TOLERANCES[precision],
            "parity_ok": diff <= TOLERANCES[precision], "parity_reference": f"{device.type} {precision}"}
