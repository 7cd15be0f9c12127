"""Which plans the executor can run, and why not the others.

One rule function for everyone: `apply` and `autopar run` refuse a plan with its reason before
any process starts, and the search space (`autopar.search.space`) leaves out what it refuses
(knob by knob: `autopar.knobs.comm_dtype_problem`), so no planner proposes a plan that cannot run. Every plan the
space holds is run on 4 gloo ranks by tests/test_executor_plans.py.
"""

from __future__ import annotations

from autopar.errors import PlanError
from autopar.knobs import comm_dtype_problem, compile_problem
from autopar.plan import Plan


def has_nccl(backend: str) -> bool:
    """Whether a process-group backend string reaches GPUs through NCCL ("nccl", "cpu:gloo,cuda:nccl")."""
    return "nccl" in backend


def refusal(plan: Plan, backend: str) -> str | None:
    """Why the executor cannot run `plan` on `backend` ("nccl", "gloo", ...), or None when it can.

    Every other combination of the plan's knobs runs (tests/test_executor_plans.py): fp16 loss
    scaling with tensor parallelism, recompute under bf16/fp16 in pipelines, interleaved
    schedules with FSDP2, optimizer offload with fp16."""
    if getattr(plan, "ep", 1) > 1 and (plan.zero == 1 or plan.sequence_parallel):
        return (f"ep={plan.ep} runs with zero 0, 2 or 3 and without sequence parallelism (ZeRO-1's optimizer would "
                f"broadcast one rank's experts over another's; sequence parallelism leaves expert gradients "
                f"unreduced over tp): use zero 0/2/3 and sequence_parallel false")
    if plan.precision == "fp8" and not has_nccl(backend):
        return (f"precision fp8 needs CUDA GPUs with fp8 tensor cores (H100, H200, B200, GB200); this run is on "
                f"{backend} (CPU processes): use precision bf16")
    return compile_problem(plan) or comm_dtype_problem(plan.grad_comm_dtype, backend)


def check_supported(plan: Plan, backend: str) -> None:
    """Raise PlanError with the reason when the executor cannot run `plan` on `backend`."""
    reason = refusal(plan, backend)
    if reason:
        raise PlanError(reason)
