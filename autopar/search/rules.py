"""The rules of thumb of the seed articles, as a baseline planner.

1. Tensor (model) parallel only when one layer's training state (16 bytes per parameter in
   mixed precision with Adam) does not fit a GPU; then the smallest degree that fits, inside a node.
2. Pipeline parallel only when the model is deep (more than 20 blocks) and its state does not
   fit after tensor parallelism; then the smallest degree that fits.
3. Data parallel on everything else; ZeRO only when the state still does not fit.
4. The largest micro-batch that fits; activation recompute only when nothing else fits.
The cost model is used only to check memory, never to compare speed.
"""

from __future__ import annotations

from autopar.cost import PlanArrays, evaluate
from autopar.errors import NoValidPlanError
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.search.space import divisors, micro_batch_choices, recompute_choices, tp_choices

STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 grads + fp32 master + two fp32 Adam moments
DEEP_MODEL_BLOCKS = 20


class RulesPlanner(Planner):
    name = "rules"

    def propose(self, workload, k: int = 1) -> list[Plan]:
        profile, cluster = workload.profile, workload.cluster
        n, memory = workload.world_size, cluster.gpu.memory_bytes
        layer_state = max(b.params for b in profile.layers) * STATE_BYTES_PER_PARAM
        model_state = profile.params * STATE_BYTES_PER_PARAM
        tps = [t for t in tp_choices(workload) if t <= cluster.gpus_per_node] or [1]
        tp = next((t for t in tps if layer_state / t <= memory), tps[-1])
        pp = 1
        if profile.num_layers > DEEP_MODEL_BLOCKS and model_state / tp > memory:
            pps = [p for p in divisors(n // tp) if p <= profile.num_layers]
            pp = next((p for p in pps if model_state / (tp * p) <= memory), pps[-1])
        dp = n // (tp * pp)
        if workload.global_batch % dp:
            raise NoValidPlanError(f"the rules pick dp={dp} (tp={tp}, pp={pp}) but the global batch "
                                   f"{workload.global_batch} is not divisible by {dp}; use a multiple of {dp}")
        candidates = []
        for zero in ((0, 1, 3) if dp > 1 else (0,)):
            for mode, blocks in [r for r in recompute_choices(workload, pp, 1) if r[0] != "selective"][::-1]:
                for mbs in sorted(micro_batch_choices(workload, dp), reverse=True):
                    nmb = workload.global_batch // (dp * mbs)
                    if pp > 1 and nmb < pp:
                        continue
                    candidates.append(Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb,
                                           zero=zero, recompute=mode, recompute_blocks=blocks,
                                           precision=workload.precision))
        # preference order: less ZeRO, then no recompute before recompute, then larger micro-batches
        candidates.sort(key=lambda p: (p.zero, p.recompute != "none", -p.micro_batch_size, p.recompute_blocks))
        if not candidates:
            raise NoValidPlanError(f"the rules found no micro-batch size for dp={dp}, pp={pp}")
        pa = PlanArrays.from_plans(candidates, profile)
        fits = evaluate(workload, pa)["fits"]
        self.evaluations = len(candidates)
        chosen = [p for p, ok in zip(candidates, fits) if ok][:k]
        if not chosen:
            raise NoValidPlanError(f"the rules' plan (dp={dp}, tp={tp}, pp={pp}) fits in memory with no "
                                   f"micro-batch size, ZeRO stage or recompute setting")
        return chosen
