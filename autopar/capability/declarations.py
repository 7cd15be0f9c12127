"""What the executor can do with a model's layout, as data, so the planner proposes only that.

The profiler records the limits in the model profile (`autopar/executor/limits.py` finds them,
with torch); the plan space leaves those choices out, `Plan.validate` refuses them (so `autopar
run` refuses before launching), and the Why table says why they are missing. Standard library
only: the plan contract imports it.
"""

from __future__ import annotations

from autopar.errors import PlanError


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


def context_parallel_allowed(workload, cp: int) -> str | None:
    """Why the workload cannot split its sequence over `cp` ranks, or None. Context parallelism
    splits attention over the sequence: the model needs attention (a score count), and causal load
    balancing cuts the sequence into 2 x cp chunks (rank i holds chunks i and 2cp-1-i)."""
    if cp == 1:
        return None
    profile = workload.profile
    if not any(getattr(b, "attn_scores", 0) > 0 for b in profile.blocks):
        return (f"cp={cp} but the model {profile.name} has no attention over a sequence to split; "
                f"use cp=1")
    limits = getattr(profile, "limits", {})
    if "cp" in limits:
        return f"cp={cp} but {limits['cp']}"
    if profile.seq_len % (2 * cp):
        return (f"cp={cp} needs the sequence length {profile.seq_len} divisible by 2 x cp = {2 * cp} (causal load "
                f"balancing cuts it into 2 x cp chunks); use a cp with 2 x cp dividing {profile.seq_len}")
    return None


# Published recipes run cp with 4,096 (NeMo 24.07, CP2 at 8K) to 8,192 (Llama 3, CP16 at 128K) tokens
# per rank; below 2,048 the sequence fits a rank without it, and the K/V exchange outgrows attention.
CP_MIN_TOKENS = 2048


def context_parallel_offered(workload, cp: int) -> str | None:
    """The plan space offers cp only while each rank keeps CP_MIN_TOKENS tokens or more (a plan may
    still name a smaller share: it is valid, runs and is priced; the space just does not search it)."""
    tokens = workload.profile.seq_len // cp
    if cp > 1 and tokens < CP_MIN_TOKENS:
        return f"cp={cp} leaves {tokens} tokens per rank; the plan space offers cp from {CP_MIN_TOKENS} up"
    return None


def check_plan(plan, profile) -> None:
    """Raise PlanError when the executor cannot run ``plan`` for this model (its limits)."""
    limits = getattr(profile, "limits", {})
    if plan.pp > 1 and "pp" in limits:
        raise PlanError(f"pp={plan.pp} but {limits['pp']}")
    if plan.tp > 1 and plan.sequence_parallel not in sequence_parallel_options(profile, plan.tp):
        why = (limits.get("sp_off") if not plan.sequence_parallel else
               limits.get("sp", f"the sequence length {profile.seq_len} is not divisible by tp={plan.tp}"))
        raise PlanError(f"sequence_parallel={str(plan.sequence_parallel).lower()} with tp={plan.tp}, but {why}")
