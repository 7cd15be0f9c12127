"""A workload's plan space restricted to a few values per knob, small enough to measure.

`RestrictedSpace` keeps the full space's decisions, slots and observation layout (a policy reads
the same action slots as on the full space) but enumerates every plan of the restriction on
construction, so the masks are exact at every decision. Measured-reward fine-tuning
(`autopar.policies.measured`) searches it; `autopar train measured --restrict` says which values.
"""

from __future__ import annotations

import numpy as np
from autopar.envs.knobs import PlanSpace, StepInfo

from autopar import axes
from autopar.errors import AutoparError
from autopar.knobs import decisions

# the default restricted space: parallel degrees and micro-batch vary, ZeRO 0/1/3 without offload,
# no / full recompute; the rest fixed (1F1B, no sequence parallelism, fp32 reduction, 25 MB
# buckets, the first mesh order)
DEFAULT_RESTRICT = {"zero": ("0", "1", "3"), "offload_optimizer": ("false",), "recompute": ("none", "full"),
                    "schedule": ("1f1b",), "sequence_parallel": ("false",), "grad_comm_dtype": ("fp32",),
                    "bucket_mb": ("25",), "mesh_order": ("first",), "compile": ("false",)}  # compiling: a minute per plan on CPU
MAX_PLANS = 100  # a restricted space is measured plan by plan: it must stay small


def restrictable() -> tuple[str, ...]:
    """Knobs a restriction may name: the decisions, and the derived degree (dp) they imply."""
    return (axes.derived_axis(),) + tuple(k.name for k in decisions())


def label(knob: str, value) -> str:
    """A knob value as `--restrict` spells it: true/false, 25, pp-dp-tp, full:3, interleaved:2."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return "-".join(value)
    if isinstance(value, tuple):
        name, count = value
        return f"{name}:{count}" if name in ("full", "interleaved") else name
    return str(value)


def _matches(knob: str, value, wanted: tuple[str, ...], values: tuple) -> bool:
    """Whether a choice passes a restriction. `first`: the first choice in slot order; recompute
    `full`: every block of the busiest stage (the most blocks among the choices)."""
    text = label(knob, value)
    if "first" in wanted and value == values[0]:
        return True
    if knob == "recompute" and value[0] == "full" and "full" in wanted:
        return value[1] == max(v[1] for v in values if v[0] == "full")
    return text in wanted


class RestrictedSpace(PlanSpace):
    """A workload's plan space with each knob restricted to some values. Every plan of it is
    enumerated on construction (at most `max_plans`), and a choice is allowed when some plan of
    the restricted space continues it: the masks are exact at every decision."""

    def __init__(self, workload, restrict: dict, coeffs=None, max_plans: int = MAX_PLANS):
        super().__init__(workload, coeffs)
        self.restrict = dict(restrict)
        full = PlanSpace(workload, coeffs)
        self.prefixes: list[tuple] = []
        self._next: dict[tuple, set] = {}
        dp = axes.derived_axis()

        def walk(prefix: tuple) -> bool:
            if len(prefix) == len(full.knobs):
                if len(self.prefixes) >= max_plans:
                    raise AutoparError(f"the restricted space has more than {max_plans} plans; restrict more knobs "
                                       f"(--restrict KNOB=VALUES)")
                self.prefixes.append(prefix)
                return True
            info = full.step(prefix)
            knob, found = full.names[len(prefix)], False
            wanted = self.restrict.get(knob)
            seen = offered.setdefault(knob, {})
            for value in info.values:
                text = label(knob, value)
                seen[text] = seen.get(text, False) or _matches(knob, value, wanted or (), info.values)
            for value, ok in zip(info.values, info.allowed):
                if not ok or (wanted is not None and not _matches(knob, value, wanted, info.values)):
                    continue
                implied = full.decided(prefix + (value,)).get(dp)
                if dp in self.restrict and implied is not None and str(implied) not in self.restrict[dp]:
                    continue
                if walk(prefix + (value,)):
                    self._next.setdefault(prefix, set()).add(value)
                    found = True
            return found

        offered: dict[str, dict[str, bool]] = {}  # per knob reached, the values offered and whether one was wanted
        walk(())
        if not self.prefixes:
            for knob in full.names:  # a value the space never offers: name it, not the space's fit
                if knob in self.restrict and knob in offered and not any(offered[knob].values()):
                    raise AutoparError(f"--restrict {knob}={','.join(self.restrict[knob])}: the plan space offers "
                                       f"{knob} = {', '.join(offered[knob])} for {workload.describe()}")
            raise AutoparError(f"no plan of the restricted space fits {workload.describe()}; relax --restrict")
        self.plans = [self.plan(p) for p in self.prefixes]

    def varying(self) -> dict[str, list[str]]:
        """The knobs that take more than one value across the space, with their values."""
        out = {}
        for s, knob in enumerate(self.names):
            # recompute: "full" is every block of the busiest stage, whatever the count per pp
            vals = list(dict.fromkeys(p[s][0] if knob == "recompute" else label(knob, p[s]) for p in self.prefixes))
            if len(vals) > 1:
                out[knob] = vals
        dp = axes.derived_axis()
        dps = sorted({self.dp_of(p) for p in self.prefixes})
        if len(dps) > 1:
            out = {dp: [str(d) for d in dps], **out}
        return out

    def fixed(self) -> dict[str, str]:
        return {knob: label(knob, self.prefixes[0][s]) for s, knob in enumerate(self.names)
                if len({p[s] for p in self.prefixes}) == 1}

    def _steps(self, prefixes: list[tuple]) -> list[StepInfo]:
        return [self._restricted(prefix, info) for prefix, info in zip(prefixes, super()._steps(prefixes))]

    def _restricted(self, prefix: tuple, info: StepInfo) -> StepInfo:
        """A step's choices allowed only where some plan of the restricted space continues them."""
        nxt = self._next.get(tuple(prefix), set())
        allowed = np.array([ok and v in nxt for v, ok in zip(info.values, info.allowed)], dtype=bool)
        return StepInfo(info.knob, info.values, info.slots, allowed, info.memory, info.time, info.evaluations)
