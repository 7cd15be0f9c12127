"""Turning a policy into plans: greedy, beam and sampled decoding over the masked action
probabilities, with the probability the policy gave each plan (its confidence)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autopar.envs.features import observation
from autopar.envs.knobs import PlanSpace


@dataclass(frozen=True)
class Decoded:
    prefix: tuple  # the knob values
    probability: float = 1.0  # product of the policy's probabilities of its choices
    min_step: float = 1.0  # the least of those probabilities: the least certain decision

    def complete(self, space: PlanSpace) -> bool:
        return len(self.prefix) == len(space.knobs)


def _expand(actor, space: PlanSpace, workload_vector, beams: list[Decoded]) -> list[Decoded]:
    """Every allowed continuation of every beam by one decision, with its probability (not yet
    advanced over forced knobs: only the continuations kept need their next step evaluated)."""
    infos = [space.step(b.prefix) for b in beams]
    obs = np.stack([observation(space, b.prefix, workload_vector) for b in beams])
    probs = actor.probabilities(obs, np.stack([info.mask() for info in infos]))
    out = []
    for beam, info, p in zip(beams, infos, probs):
        for value, slot, ok in zip(info.values, info.slots, info.allowed):
            if ok:
                out.append(Decoded(beam.prefix + (value,), beam.probability * float(p[slot]),
                                   min(beam.min_step, float(p[slot]))))
    return out


def beam_search(actor, space: PlanSpace, workload_vector, width: int, start: tuple = ()) -> list[Decoded]:
    """The `width` most probable complete decisions sequences (width 1: greedy decoding) that begin
    with the decisions `start` (their probabilities then conditional on it); none when no plan that
    fits begins with it."""
    return beam_searches(actor, space, workload_vector, width, [start])[0]


def beam_searches(actor, space: PlanSpace, workload_vector, width: int, starts: list[tuple]) -> list[list[Decoded]]:
    """`beam_search` from each start, the searches in lockstep: each decision's steps of every live beam of
    every search are priced in one cost-model call (`PlanSpace.prefetch`), the same beams as one by one."""
    pools = [[Decoded(p)] for p in space.advance_each(list(starts))]
    while True:
        live = [[d for d in pool if not d.complete(space)] for pool in pools]
        if not any(live):
            return pools
        space.prefetch([d.prefix for beams in live for d in beams])
        for n, beams in enumerate(live):
            if beams:
                pool = [d for d in pools[n] if d.complete(space)] + _expand(actor, space, workload_vector, beams)
                pools[n] = sorted(pool, key=lambda d: -d.probability)[:width]
        advanced = iter(space.advance_each([d.prefix for pool in pools for d in pool]))
        pools = [[replace(d, prefix=next(advanced)) for d in pool] for pool in pools]


def sample(actor, space: PlanSpace, workload_vector, k: int, rng: np.random.Generator,
           max_draws: int | None = None) -> list[Decoded]:
    """Up to k distinct sequences drawn from the policy (at most max_draws draws, default 8k)."""
    found: dict[tuple, Decoded] = {}
    for _ in range(max_draws or 8 * k):
        d = Decoded(space.advance(()))
        while not d.complete(space):
            info = space.step(d.prefix)
            obs = observation(space, d.prefix, workload_vector)[None]
            p = actor.probabilities(obs, info.mask()[None])[0]
            slot = int(rng.choice(len(p), p=p))
            d = replace(d, prefix=space.advance(d.prefix + (info.value_at(slot),)),
                        probability=d.probability * float(p[slot]), min_step=min(d.min_step, float(p[slot])))
        found.setdefault(d.prefix, d)
        if len(found) == k:
            break
    return sorted(found.values(), key=lambda d: -d.probability)


def greedy(actor, space: PlanSpace, features) -> tuple:
    """The plan (as a prefix) the policy ranks first: a beam of width 1."""
    return beam_search(actor, space, features, 1)[0].prefix
