"""The rules of thumb of the seed articles, as a baseline planner.

1. Tensor (model) parallel only when one layer's training state (16 bytes per parameter in
   mixed precision with Adam) does not fit a GPU; then the smallest degree that fits, inside a node.
2. Pipeline parallel only when the model is deep (more than 20 blocks) and its state does not
   fit after tensor parallelism; then the smallest degree that fits.
3. Data parallel on everything else; ZeRO only when the state still does not fit.
4. The largest micro-batch that fits; activation recompute only when nothing else fits.
When the degrees so chosen admit no plan (the batch does not divide, or nothing fits), model
parallelism grows one step at a time in the same spirit: pipeline first for deep models,
tensor parallel inside a node first otherwise. The cost model is used only to check memory,
never to compare speed.
"""

from __future__ import annotations

from autopar.axes import AXES, divisors
from autopar.cost import PlanArrays, evaluate
from autopar.errors import NoValidPlanError, PlanError
from autopar.knobs import STATE_BYTES_PER_PARAM, knob
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.search.simplicity import simplicity_key
from autopar.search.space import choices, degree_choices, held_fields, in_space
DEEP_MODEL_BLOCKS = 20


class RulesPlanner(Planner):
    name = "rules"

    def propose(self, workload, k: int = 1) -> list[Plan]:
        self.evaluations = 0
        for dp, tp, pp in self._degrees(workload):
            chosen = self._fitting(workload, dp, tp, pp, k)
            if chosen:
                return chosen
        raise NoValidPlanError(f"the rules of thumb find no plan that fits: no data / tensor / pipeline split of "
                               f"{workload.world_size} GPUs divides the global batch {workload.global_batch} "
                               f"and fits in memory; try --method exhaustive")

    def _degrees(self, workload) -> list[tuple[int, int, int]]:
        """(dp, tp, pp) in the rules' order: the rule's own choice, then more model parallelism."""
        profile, cluster = workload.profile, workload.cluster
        n, memory = workload.world_size, workload.memory_budget
        layer_state = max(b.params for b in profile.layers) * STATE_BYTES_PER_PARAM
        model_state = profile.params * STATE_BYTES_PER_PARAM
        tps = [t for t in divisors(n) if AXES["tp"].allowed(workload, t) is None]
        inside = [t for t in tps if t <= cluster.gpus_per_node] or [1]
        tp = next((t for t in inside if layer_state / t <= memory), inside[-1])
        deep = profile.num_layers > DEEP_MODEL_BLOCKS
        pps = [p for p in divisors(n // tp) if p <= profile.num_layers]
        pp = 1
        if deep and model_state / tp > memory:
            pp = next((p for p in pps if model_state / (tp * p) <= memory), pps[-1])
        first = (tp, pp)
        rest = [(t, p) for t in tps for p in divisors(n // t) if p <= profile.num_layers and (t, p) != first]
        # grow model parallelism: fewest model-parallel GPUs first; deep models pipeline before
        # splitting layers, shallow ones split layers (inside a node) before pipelining
        rest.sort(key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[0] > cluster.gpus_per_node,
                                     tp_pp[0] if deep else tp_pp[1]))
        allowed = {(d["dp"], d["tp"], d["pp"]) for d in degree_choices(workload)}  # what the executor can run
        return [(n // (t * p), t, p) for t, p in [first, *rest] if (n // (t * p), t, p) in allowed]

    def _fitting(self, workload, dp: int, tp: int, pp: int, k: int) -> list[Plan]:
        candidates = []
        # fp8: the first recipe the GPU runs, compiled where compile is offered (fp8 pays only compiled)
        recipe = choices(workload, knob("fp8_recipe"), {"precision": workload.precision})[0]
        compiled = workload.precision == "fp8" and True in choices(workload, knob("compile"), {"tp": tp, "pp": pp})
        sp = choices(workload, knob("sequence_parallel"), {"tp": tp})[-1]  # on where it runs
        for zero in ((0, 1, 3) if dp > 1 else (0,)):
            recompute = choices(workload, knob("recompute"), {"pp": pp})
            for mode, blocks in [r for r in recompute if r[0] != "selective"]:
                for mbs in choices(workload, knob("micro_batch_size"), {"dp": dp}):
                    nmb = workload.global_batch // (dp * mbs)
                    if pp > 1 and nmb < pp:
                        continue
                    candidates.append(Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb,
                                           zero=zero, recompute=mode, recompute_blocks=blocks,
                                           precision=workload.precision, fp8_recipe=recipe, compile=compiled,
                                           sequence_parallel=sp))
        held = held_fields(workload)  # `search --fix`: the rules' choices give way to the held values
        if held:
            candidates = list(dict.fromkeys(p for p in (_with(c, held) for c in candidates)
                                            if p is not None and in_space(workload, p)))
        if not candidates:
            return []
        # preference order: the simplest plan (less ZeRO, no recompute: simplicity_key), then larger micro-batches
        candidates.sort(key=lambda p: (simplicity_key(p), -p.micro_batch_size))
        fits = evaluate(workload, PlanArrays.from_plans(candidates, workload.profile))["fits"]
        self.evaluations += len(candidates)
        return [p for p, ok in zip(candidates, fits) if ok][:k]


def _with(plan: Plan, fields: dict) -> Plan | None:
    try:
        return plan.with_(**fields)
    except PlanError:  # the held values with this candidate's others make no plan
        return None
