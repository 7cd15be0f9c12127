"""The single-process reference that every plan's losses must reproduce (DESIGN §8).

Same seed, same initial weights, same global batches, one process, no parallelism: a parallel
plan that is correct gives the same per-step global-batch losses up to float rounding.
"""

from __future__ import annotations

from autopar.executor.train_step import build_full_model


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
