"""What the executor can do with a model's layout, so the planner proposes only that.

The profiler records the limits in the model profile; the plan space leaves those choices out,
`Plan.validate` refuses them (so `autopar run` refuses before launching), and the Why table
says why they are missing.
"""

from __future__ import annotations

from torch import nn

from autopar.errors import PlanError


def model_limits(model: nn.Module, blocks: nn.ModuleList | None, tp_plan: dict) -> dict[str, str]:
    """{knob: why the executor cannot do it for this model}: ``pp`` (pipeline parallelism),
    ``sp`` (sequence parallelism) and ``sp_off`` (tensor parallelism without it)."""
    from autopar.executor.pipeline import check_layout
    from autopar.executor.tensor_parallel import INPUT
    from autopar.modelfile import sequence_parallel_styles

    limits = {}
    if blocks is None:
        limits["pp"] = "pipeline parallelism needs the model's repeated blocks (an nn.ModuleList); use pp=1"
    else:
        try:
            check_layout(model, blocks)
        except PlanError as exc:
            limits["pp"] = str(exc)
    styles_sp = sequence_parallel_styles(tp_plan)
    if styles_sp is True:
        limits["sp_off"] = ("the tp_plan's ParallelStyles shard the sequence (SequenceParallel), so tensor "
                            "parallelism runs with sequence parallelism on")
    elif styles_sp is False:
        limits["sp"] = "the tp_plan's ParallelStyles do not shard the sequence (no SequenceParallel entry)"
    elif tp_plan and not hasattr(model, INPUT):
        limits["sp"] = (f"sequence parallelism needs the model's input module named '{INPUT}' (torchtitan "
                        "layout) to know where the sequence is split")
    return limits


def sequence_parallel_options(profile, tp: int) -> tuple[bool, ...]:
    """The sequence-parallel choices the executor can run at tensor-parallel degree ``tp``."""
    if tp == 1:
        return (False,)
    limits = getattr(profile, "limits", {})
    if "sp_off" in limits:
        return (True,) if profile.seq_len % tp == 0 else ()
    if "sp" in limits or profile.seq_len % tp:
        return (False,)
    return (False, True)


def check_plan(plan, profile) -> None:
    """Raise PlanError when the executor cannot run ``plan`` for this model (its limits)."""
    limits = getattr(profile, "limits", {})
    if plan.pp > 1 and "pp" in limits:
        raise PlanError(f"pp={plan.pp} but {limits['pp']}")
    if plan.tp > 1 and plan.sequence_parallel not in sequence_parallel_options(profile, plan.tp):
        why = (limits.get("sp_off") if not plan.sequence_parallel else
               limits.get("sp", f"the sequence length {profile.seq_len} is not divisible by tp={plan.tp}"))
        raise PlanError(f"sequence_parallel={str(plan.sequence_parallel).lower()} with tp={plan.tp}, but {why}")
