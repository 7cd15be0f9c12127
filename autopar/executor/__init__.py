"""The executor: applies a Plan with PyTorch's own distributed stack.

Public API (imported lazily, so `import autopar.executor` costs nothing until used):

* `apply(plan, build_model, optimizer, loss_fn, *, tp_plan, blocks, seed)` -> `ParallelModel`
  with `train_step(inputs, targets)`, `local_batch(...)`, `global_losses(...)` and `close()`
  (before `destroy_process_group`);
* `make_loader(dataset, plan, topo)`: a DistributedSampler loader of this rank's batches, in the
  dataset's order unless `shuffle=True`, so step 1 is a single process's first global batch (whole
  sequences: under context parallelism `shard_sequence(batch, plan.cp, topo.rank("cp"))` cuts a
  batch to the rank's tokens, as `local_batch` does);
* `train_elastic(plan, build_model, optimizer, loss_fn, batch, *, checkpoint_dir, steps, replan)`:
  the training loop of elastic runs (checkpoints, re-plans on a new world size, resumes);
* `save_checkpoint(par, path, step)` / `load_checkpoint(par, path)`: DCP checkpoints that
  resume under another plan;
* one measured run (check, predict, launch, record) is `autopar.traces.run_plan.run_plan`, a layer
  above: it builds trace records, which the executor knows nothing of (docs/architecture.md);
* `autopar.executor.launch.launch(plan_path, model, model_args, RunOptions(...))`: torchrun a
  plan's workers on this node and classify how the job ended (what `run_plan` calls);
* `RunOptions`: how a plan runs (steps, warm-up, ranks, backend, timeout, ...), declared once;
"""

from importlib import import_module

_EXPORTS = {
    "apply": "train_step", "ParallelModel": "train_step", "make_loader": "data",
    "save_checkpoint": "state", "load_checkpoint": "state",
    "reference_losses": "parity", "shard_sequence": "context_parallel", "RunOptions": "options", "train_elastic": "elastic",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autopar.executor' has no attribute {name!r}")
    return getattr(import_module(f"autopar.executor.{_EXPORTS[name]}"), name)
