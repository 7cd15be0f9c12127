"""The executor's checks of a plan against a model, on the meta device, before any process starts.

`apply` would raise the same PlanErrors on every rank after torchrun started them all;
`autopar run` calls `preflight` first and refuses in one line instead.
"""

from __future__ import annotations

from autopar.errors import PlanError
from autopar.executor.pipeline import check_layout, cut_stages
from autopar.executor.tensor_parallel import tp_styles


def preflight(plan, model_file, model_args: dict) -> None:
    """Raise PlanError when `apply(plan, ...)` cannot lay this model out: a missing or empty
    tp_plan, blocks the pipeline cannot cut, sequence parallelism the layout does not allow."""
    model = model_file.build(**model_args)
    blocks = model_file.blocks(model)
    tp_map = {}
    if plan.tp > 1:
        tp_map = model_file.tp_plan(model)
        if not tp_map:
            raise PlanError(f"the plan has tp={plan.tp} but {model_file.name} has no (non-empty) tp_plan; "
                            "use a plan with tp=1")
    if plan.pp > 1:
        if blocks is None:
            raise PlanError("pipeline parallelism needs the model's repeated blocks (an nn.ModuleList); use pp=1")
        name = check_layout(model, blocks)
        parts = [part for rank in range(plan.pp) for part in cut_stages(model, blocks, plan, rank)]
        containers = [getattr(part, name) for part in parts]
    else:
        parts, containers = [model], [blocks]
    if plan.tp > 1:
        for part, container in zip(parts, containers):
            tp_styles(part, tp_map, container, plan.sequence_parallel)
