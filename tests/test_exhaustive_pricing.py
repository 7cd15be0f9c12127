"""The exhaustive search prices a plan with recompute only where its floor (its sibling without recompute's
time less what recompute could hide or move: `search/pricing.py`) says it could matter: the floor holds on
every plan of real spaces, and the search answers exactly as when it prices every plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import workload

from autopar.cost import evaluate
from autopar.errors import NoValidPlanError
from autopar.knobs import RECOMPUTE_MODES
from autopar.search import pricing
from autopar.search.exhaustive import ExhaustivePlanner
from autopar.search.fixed import parse_fixes, with_fixes
from autopar.search.space import enumerate_plans

SPACES = [  # a dense GPT, a large vocabulary, a mixture of experts, a V schedule's space, context parallel
    dict(model="gpt", cluster="dgx-a100-40g", nodes=4, global_batch=64, size="1.7b", layers=24, seq_len=2048),
    dict(model="llama", cluster="pcie-4090x8", nodes=2, global_batch=32, size="small", layers=20, seq_len=2048,
         vocab=151936),
    dict(model="moe", cluster="dgx-a100-40g", nodes=2, global_batch=32, size="small", layers=12, seq_len=2048),
    dict(model="llama", cluster="dgx-h100", nodes=4, global_batch=64, size="small", layers=16, seq_len=16384),
]
OTHER_RUNTIMES = [  # Megatron-Core's overlaps and TE's fp8, torch's fp8 (casts replayed by recompute)
    dict(model="gpt", cluster="dgx-h100", nodes=4, global_batch=128, size="1.7b", layers=24, seq_len=2048,
         options=dict(runtime="megatron-core", fp8=True)),
    dict(model="llama", cluster="dgx-h100", nodes=2, global_batch=32, size="small", layers=16, seq_len=4096,
         options=dict(fp8=True)),
]


def _workload(spec: dict):
    spec = dict(spec)
    options = spec.pop("options", {})
    return dataclasses.replace(workload(spec.pop("model"), spec.pop("cluster"), **spec), **options)


@pytest.mark.heavy
@pytest.mark.parametrize("spec", SPACES + OTHER_RUNTIMES,
                         ids=lambda s: f"{s['model']}-{s['cluster']}-{s['seq_len']}-{s.get('options', {})}")
def test_every_plan_with_recompute_takes_at_least_its_siblings_floor(spec):
    """On every plan of each space: a plan with recompute takes at least the floor of its sibling without it,
    and every outer plan has that sibling (a plan without one would always be priced)."""
    w = _workload(spec)
    space = enumerate_plans(w)
    res = evaluate(w, space, ranks=True)
    group = pricing.outer_groups(space)
    plain = space.recompute == RECOMPUTE_MODES.index("none")
    floors = np.full(group.max() + 1, np.nan)
    floors[group[plain]] = pricing.floor_of({k: v[plain] for k, v in res.items()})
    floor = floors[group]
    assert not np.isnan(floor).any()
    time = res["iteration_time"]
    assert (time[~plain] >= floor[~plain] - 1e-12 * time[~plain]).all()
    assert (floor[plain] <= time[plain]).all() and (~plain).sum() > 4 * plain.sum()
    assert len(set(space.schedule.tolist())) >= 2  # schedules of several kinds (zero-bubble ones under torch)


def _answers(w, prune: bool, k: int = 3):
    planner = ExhaustivePlanner(prune=prune)
    try:
        pa, res = planner.ranked(w, k)
    except NoValidPlanError as e:
        return str(e), planner
    return ([pa.plan(i) for i in range(len(pa))], res["iteration_time"].tolist(), planner.solved,
            planner.exact), planner


@pytest.mark.heavy
@pytest.mark.parametrize("spec,fix", [(s, None) for s in SPACES + OTHER_RUNTIMES] + [
    (SPACES[0], "recompute=selective"),  # no plan without recompute: every plan priced
    (dict(SPACES[0], nodes=1, global_batch=8, size="175b", layers=48), None),  # nothing fits: the least memory told
])
def test_the_pruned_search_answers_as_pricing_every_plan(spec, fix):
    """The same k plans, times, per-stage solves and proof as the search that prices every plan, having priced
    fewer where the space has plans without recompute and something fits."""
    w = _workload(spec)
    if fix:
        w = with_fixes(w, parse_fixes([fix]))
    pruned, planner = _answers(w, True)
    full, every = _answers(w, False)
    assert pruned == full
    assert every.evaluations == every.plans == planner.plans
    if fix is None and not isinstance(full, str):
        assert planner.evaluations < planner.plans / 2, (planner.evaluations, planner.plans)
    else:
        assert planner.evaluations == planner.plans
