"""The executor's checks of a plan against a model, on the meta device, before any process starts.

`apply` would raise the same PlanErrors on every rank after torchrun started them all;
`autopar run` calls `preflight` first and refuses in one line instead: what the executor can run
for this layout (`autopar.capability`, asked through `support.check_supported`), then the cut and
the tensor-parallel styles laid out as `apply` lays them.
"""

from __future__ import annotations

from autopar.executor.pipeline import cut_stages, held_blocks
from autopar.executor.facts import model_layout
from autopar.executor.support import check_supported
from autopar.executor.tensor_parallel import tp_styles
from autopar.layout import forward_layout


def preflight(plan, model_file, model_args: dict, backend: str | None = None) -> None:
    """Raise PlanError when `apply(plan, ...)` cannot lay this model out: what the torch runtime
    cannot run for its layout (a missing or empty tp_plan, blocks the pipeline cannot cut, sequence
    parallelism the layout does not allow), or a cut or style that fails."""
    model = model_file.build(**model_args)
    blocks = model_file.blocks(model)
    tp_map = model_file.tp_plan(model) if plan.tp > 1 else {}
    check_supported(plan, backend, model_layout(model, blocks, tp_map, model_file.name))
    layout = forward_layout(model, blocks)
    parts = ([part for rank in range(plan.pp) for part in cut_stages(model, blocks, plan, rank, layout)]
             if plan.pp > 1 else [model])
    if plan.tp > 1:
        for part in parts:
            tp_styles(part, tp_map, [c._modules[k] for c, k in held_blocks(part, layout)], plan.sequence_parallel,
                      layout)
