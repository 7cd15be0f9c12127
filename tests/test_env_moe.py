"""The planning environment on mixtures of experts: the ep decision, its masks, the training mix."""

from __future__ import annotations

import numpy as np
from conftest import workload

from autopar import axes
from autopar.cost import estimate
from autopar.envs.knobs import PlanSpace
from autopar.envs.workloads import families, family_sizes, sample_training_spec


def _ep_step(space: PlanSpace, rng):
    """Walk the masks to the ep decision (random allowed choices before it); its StepInfo and dp."""
    prefix = ()
    while space.names[len(prefix)] != "ep":
        info = space.step(prefix)
        prefix += (info.values[rng.choice(np.flatnonzero(info.allowed))],)
    return prefix, space.step(prefix), space.dp_of(prefix)


def test_ep_choices_are_exactly_the_valid_degrees_and_masks_keep_the_fitting_ones():
    """Tiny MoE (8 experts) on 8 GPUs: the ep decision offers the divisors of gcd(experts, dp), each
    allowed exactly when a plan with it fits; a completed plan validates and fits."""
    w = workload("moe", cluster="dgx-h100", nodes=1, global_batch=32, size="tiny")
    space, rng = PlanSpace(w), np.random.default_rng(0)
    for _ in range(4):
        prefix, info, dp = _ep_step(space, rng)
        assert list(info.values) == [d for d in axes.divisors(dp) if w.profile.num_experts % d == 0]
        for value, allowed in zip(info.values, info.allowed):
            completion = space.best_completion(prefix + (value,))
            assert allowed == (completion is not None)
            if completion is not None:
                plan = space.plan(completion)
                plan.validate(w)
                assert plan.ep == value and estimate(w, plan).fits


def test_dense_models_offer_ep_1_only():
    w = workload("llama", cluster="dgx-h100", nodes=1, global_batch=32, size="tiny")
    _, info, _ = _ep_step(PlanSpace(w), np.random.default_rng(1))
    assert list(info.values) == [1]


def test_training_mix_draws_moe_workloads(monkeypatch):
    """The sampler draws the zoo's MoE family at its share, with its named sizes (sizing the cluster
    needs the parameter count: a stand-in here, so no model is profiled)."""
    from autopar.envs import workloads

    monkeypatch.setattr(workloads, "_approx_params", lambda spec: 1e9)
    rng = np.random.default_rng(7)
    drawn = [s for s in (sample_training_spec(rng) for _ in range(150)) if s is not None]
    moe = [s for s in drawn if s.model == "moe"]
    assert "moe" in families()
    assert len(drawn) / len(families()) / 2 < len(moe) < 2 * len(drawn) / len(families())
    assert {dict(s.model_args)["size"] for s in moe} <= set(family_sizes("moe")[0])
