"""The RL planner (`autopar search --method rl`): a trained policy picks each knob in one forward pass.

By default the planner beam-decodes max(k, BEAM) distinct plans (or samples them, with
`decode="sample"`), refines the fastest of them by coordinate descent with the cost model
(`policies/refine.py`: one knob changed at a time while that helps), then trades factors between
the degrees of the fastest refined plan, the policy choosing the other knobs again for each new
layout (`policies/trade.py`), and ranks the decoded and refined plans with the cost model;
`beam=1, refine=False` is the policy alone (greedy decoding). The evaluations it reports are
every plan the cost model saw: the masks' lean completions, the refinement's neighbours, the
trades' completions and the ranking. The policy's confidence in each returned plan is kept:
the product of the probabilities of its decisions and the least of them (none for a plan that
refinement or simplification found and the policy did not decode).

The policy decides the uniform knobs (degrees, micro-batching, one recompute setting, schedule...);
the per-stage knobs (each stage's blocks and recompute) are the exact per-stage solver's
(`autopar/search/stages.py`): it finishes the outer plans of the FINISH best distinct plans and of
the NEIGHBOURS other plans the search saw (the trades' completions of other layouts among them) of least
lower bound, and a finished plan leads when it beats the best uniform plan beyond the tie band (`simplicity.TIE`), as in
the exhaustive search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.axes import axis_names
from autopar.cost import PlanArrays, evaluate
from autopar.envs.features import workload_features
from autopar.envs.knobs import PlanSpace
from autopar.errors import AutoparError
from autopar.knobs import ZERO_BUBBLE
from autopar.plan import Plan
from autopar.policies.decode import beam_search, sample
from autopar.policies.fingerprint import stale_note
from autopar.policies.load import default_policy_path, load_policy
from autopar.policies.refine import refine
from autopar.policies.trade import policy_completion, trade, traded_outer_plans
from autopar.search.base import Planner
from autopar.errors import PlanError
from autopar.search import stages
from autopar.search.exhaustive import memory_error, no_plan_error
from autopar.search.simplicity import TIE, simpler_variants, simplest_first

DECODERS = ("beam", "sample")
BEAM = 8  # plans decoded by default, whatever k: the cost model ranks them
REFINE_STARTS = 4  # decoded plans that coordinate descent starts from
FINISH = 2  # distinct outer plans of the best plans that the per-stage solver finishes
NEIGHBOURS = 10  # more outer plans it finishes: of every plan the search saw, those of the least lower bound
PROMISING = 2  # and the fastest uniform plans' of other layouts among them (the exhaustive search does so too)


def starts(plans: list[Plan], times: np.ndarray) -> list[int]:
    """The decoded plans refinement starts from: the fastest plan of each distinct set of axis
    degrees first (descents from one layout tend to meet in one local optimum), fastest first."""
    order = [int(i) for i in np.argsort(times, kind="stable") if np.isfinite(times[i])]
    degrees = [tuple(getattr(plans[i], a) for a in axis_names()) for i in order]
    firsts = [i for n, i in enumerate(order) if degrees[n] not in degrees[:n]]
    return (firsts + [i for i in order if i not in firsts])[:REFINE_STARTS]


@dataclass(frozen=True)
class Confidence:
    probability: float  # the policy's probability of the whole plan (product over its decisions)
    min_step: float  # the probability of its least certain decision

    def describe(self) -> str:
        return (f"policy confidence {self.probability:.0%}: the trained policy's probability of choosing exactly this "
                f"plan, knob by knob (its least certain knob: {self.min_step:.0%}); low means several plans looked "
                f"alike to it, and the cost model ranked its candidates")


def as_1f1b(plan: Plan) -> Plan:
    """A pipelined zero-bubble or DualPipe plan as 1F1B, a neighbour the finish weighs too (a per-stage
    1F1B plan, its split and recompute free, can beat a zero-bubble one); others unchanged."""
    if plan.pp < 2 or plan.schedule not in ZERO_BUBBLE:
        return plan
    return plan.with_(schedule="1f1b", virtual_stages=1)


def layout(plan: Plan) -> tuple:
    """A plan's degrees, micro-batching and schedule: what the per-stage solver's optimum depends on most."""
    return (*(getattr(plan, a) for a in axis_names()), plan.micro_batch_size, plan.num_micro_batches,
            plan.schedule, plan.virtual_stages)


class RLPlanner(Planner):
    name = "rl"

    def __init__(self, policy=None, seed: int = 0, decode: str = "beam", beam: int = BEAM,
                 refine: bool = True, trades: bool = True, per_stage: bool = True):
        super().__init__()
        if decode not in DECODERS:
            raise AutoparError(f"unknown decode {decode!r}; choose one of {list(DECODERS)}")
        if beam < 1:
            raise AutoparError(f"the beam width must be at least 1, got {beam}")
        self.actor = load_policy(policy)  # checks the space signature: fail before any search
        self.stale_note = stale_note(self.actor.meta, policy or default_policy_path())
        self.seed, self.decode, self.beam, self.refine, self.trades = seed, decode, beam, refine, trades
        self.per_stage = per_stage
        self.finished: list[Plan] = []  # the outer plans the per-stage solver finished in the last propose()
        self.last_confidence: Confidence | None = None  # of the best plan of the last propose()
        self.confidences: list[Confidence | None] = []  # of every plan of the last propose(), in order

    def propose(self, workload, k: int = 1) -> list[Plan]:
        space = PlanSpace(workload)
        first = space.step(())
        if not first.allowed.any():
            least = float(first.memory.min()) if first.values else np.inf  # inf: no completion at all (--fix)
            raise memory_error(workload, least) if np.isfinite(least) else no_plan_error(workload)
        features = workload_features(workload)
        width = max(k, self.beam)
        if width > 1 and self.decode == "sample":
            decoded = sample(self.actor, space, features, width, np.random.default_rng(self.seed))
        else:
            decoded = beam_search(self.actor, space, features, width)
        plans = [space.plan(d.prefix) for d in decoded]
        confidences = [Confidence(d.probability, d.min_step) for d in decoded]
        spent, traded = 0, []
        if self.refine:
            spent += len(plans)  # the decoded plans' estimates, to pick the refinement's starts
            res = evaluate(workload, PlanArrays.from_plans(plans, workload.profile))
            times = np.where(res["fits"], res["iteration_time"], np.inf)
            seen: dict = {}
            refined = [refine(space, decoded[i].prefix, seen=seen) for i in starts(plans, times)]
            if refined and self.trades:  # then trades between layouts, from the fastest refined plan
                complete = policy_completion(self.actor, space, features)
                refined.append(trade(space, min(refined, key=lambda r: r.time_s), complete, seen=seen,
                                     completions=traded))
            for found in refined:
                spent += found.evaluations
                plan = space.plan(found.prefix)
                if plan not in plans:
                    plans.append(plan)
        # the policy may pick a needless knob among ties: its plans' simpler variants join the ranking
        variants = list(dict.fromkeys(v for p in plans for v in simpler_variants(workload, p) if v not in plans))
        res = evaluate(workload, PlanArrays.from_plans(plans + variants, workload.profile))
        keep = [i for i in range(len(plans) + len(variants)) if i < len(decoded) or res["fits"][i]]
        candidates = [(plans + variants)[i] for i in keep]
        order = simplest_first(candidates, res["iteration_time"][keep])[:max(k, 1)]
        self.evaluations = space.evaluations + spent + len(plans) + len(variants)
        self.confidences = [confidences[keep[i]] if keep[i] < len(decoded) else None for i in order]
        best = [candidates[i] for i in order]
        seen_plans = candidates + [space.plan(p) for p in traded]  # the trades' completions: other layouts
        if self.per_stage:  # and its best plan in layouts where no uniform plan fits, for the finish
            seen_plans += traded_outer_plans(space, best[0])
        staged = (self._finish(workload, best, float(res["iteration_time"][keep][order[0]]), seen_plans)
                  if self.per_stage else None)
        if staged is not None:
            best = [staged] + best[:max(k, 1) - 1]
            self.confidences = [None] + self.confidences[:max(k, 1) - 1]
        self.last_confidence = self.confidences[0]
        return best

    def _finish(self, workload, plans: list[Plan], best_time: float, others: list[Plan] = ()) -> Plan | None:
        """The best per-stage plan from the outer plans of the FINISH best distinct plans and of the
        NEIGHBOURS other plans the search saw (`others`: decoded, refined, simpler variants, the trades'
        completions of other layouts) whose lower bound (`stages.lower_bound`) is least and can beat
        `best_time`, when it is faster than `best_time` beyond the tie band and the runtime runs it; else
        None. The neighbours are what a balanced split hides: an outer plan slow when uniform (pp14 of a
        152k-token vocabulary, its ends each beside one block) can be the fastest per stage."""
        if "recompute" in dict(getattr(workload, "fixed", ())):
            return None  # a held recompute setting holds every stage's
        worth = lambda p: stages.worth_solving(p, workload.profile)  # noqa: E731
        outer = list(dict.fromkeys(stages.outer_of(p) for p in plans if worth(p)))[:FINISH]
        if others and PROMISING:  # the outer plans of the fastest uniform plans of other layouts it saw
            res = evaluate(workload, PlanArrays.from_plans(list(others), workload.profile))
            self.evaluations += len(others)
            fastest: dict = {}
            for i in np.argsort(np.where(res["fits"], res["iteration_time"], np.inf), kind="stable"):
                o = stages.outer_of(others[int(i)])
                if not res["fits"][i] or len(fastest) >= PROMISING:
                    break
                if worth(o) and o not in outer and layout(o) not in {layout(p) for p in outer}:
                    fastest.setdefault(layout(o), o)
            outer += list(fastest.values())
        rest = [p for p in dict.fromkeys(stages.outer_of(p) for p in [*plans, *others, *map(as_1f1b, plans)]
                                         if worth(p)) if p not in outer]
        if rest and NEIGHBOURS:
            bound = stages.outer_bounds(workload, rest)
            self.evaluations += len(rest)
            order = [int(i) for i in np.argsort(bound, kind="stable") if bound[i] < best_time * (1 - TIE)]
            # the least bound of each layout and micro-batching first (their data-parallel details after)
            firsts = list({layout(rest[i]): i for i in reversed(order)}.values())[::-1]
            firsts.sort(key=order.index)
            outer += [rest[i] for i in (firsts + [i for i in order if i not in firsts])[:NEIGHBOURS]]
        target, skeletons = best_time * (1 - TIE), {}  # what the two solves' outer plans of one pp share
        found = [s for s in stages.solve(workload, outer, target=target, skeletons=skeletons)
                 if s is not None and s.fits]
        # the best outer plan finished with its data-parallel details changed: memory its split frees can
        # drop an offload or a ZeRO stage its uniform plans needed
        lead = min(found, key=lambda s: s.iteration_time).plan if found else outer[0] if outer else None
        variants = [v for v in stages.detail_variants(workload, lead) if v not in outer and worth(v)] if lead else []
        if variants:
            bound = stages.outer_bounds(workload, variants)
            variants = [v for v, b in zip(variants, bound) if b < min([target] + [s.iteration_time for s in found])]
            found += [s for s in stages.solve(workload, variants, target=target, skeletons=skeletons)
                      if s is not None and s.fits]
        self.finished = outer + variants
        self.evaluations += len(outer) + len(variants)
        for s in sorted(found, key=lambda s: s.iteration_time):
            try:
                s.plan.validate(workload)  # what the runtime runs (capability rules)
            except PlanError:
                continue
            return self._best_mesh(workload, s.plan, s.iteration_time)
        return None

    def _best_mesh(self, workload, plan: Plan, time_s: float) -> Plan:
        """`plan` in the mesh order (`stages.mesh_variants`) that makes it fastest and that the runtime runs."""
        variants = stages.mesh_variants(workload, plan)
        if not variants:
            return plan
        res = evaluate(workload, PlanArrays.from_plans(variants, workload.profile))
        self.evaluations += len(variants)
        for i in np.argsort(res["iteration_time"], kind="stable"):
            if res["iteration_time"][i] >= time_s:
                break
            if not res["fits"][i]:
                continue
            try:
                variants[int(i)].validate(workload)
            except PlanError:
                continue
            return variants[int(i)]
        return plan
