"""The single-process reference that every plan's losses must reproduce (DESIGN §8).

Same seed, same initial weights, same global batches, one process, no parallelism: a parallel
plan that is correct gives the same per-step global-batch losses up to float rounding.
"""

from __future__ import annotations

from torch import nn

from autopar.executor.train_step import build_full_model

PARITY_TOLERANCE = 1e-5  # fp32: float rounding in another reduction order stays well below this


def reference_losses(build_model, optimizer, loss_fn, batches, seed: int = 0) -> list[float]:
    """Per-step losses of a plain training loop over `batches` ((inputs tuple, targets) pairs)."""
    model = build_full_model(build_model, seed)
    opt = optimizer(list(model.parameters()))
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
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


def parity_verdict(difference: float, causes: list[str]) -> str:
    """One line: within tolerance, or the difference and its likely causes."""
    if difference <= PARITY_TOLERANCE:
        return f"matches one process (max rel. diff {difference:.1e} <= {PARITY_TOLERANCE:.0e})"
    why = "; ".join(causes) if causes else "no dropout, BatchNorm or low precision explains it: a bug"
    return f"differs from one process by {difference:.1e} (> {PARITY_TOLERANCE:.0e}): {why}"
