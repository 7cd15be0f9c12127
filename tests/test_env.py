"""The planning environment: Gymnasium and SB3 conformance, masks that keep exactly the fitting
plans of the space reachable, seeding, reward backends, and the workload sets."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cost import estimate, evaluate
from autopar.envs import ENV_ID
from autopar.envs.knobs import MAX_ACTIONS, PlanSpace
from autopar.envs.parallel_plan_env import ParallelPlanEnv
from autopar.errors import AutoparError
from autopar.envs.rewards import INVALID_REWARD
from autopar.search.space import enumerate_plans
from conftest import workload


def small_workloads():
    return [workload(size="tiny", nodes=1, global_batch=32),
            workload("llama", size="tiny", nodes=1, gpus_per_node=6, global_batch=24)]


def test_env_passes_gymnasium_and_sb3_checks():
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = gym.make(ENV_ID, workloads=small_workloads())
    check_env(env.unwrapped)
    sb3_check_env(env.unwrapped)
    assert env.action_space.n == MAX_ACTIONS


def test_seeded_resets_repeat_and_a_given_workload_is_used():
    a, b = ParallelPlanEnv(small_workloads()), ParallelPlanEnv(small_workloads())
    obs_a = [a.reset(seed=3)[0]] + [a.reset()[0] for _ in range(4)]
    obs_b = [b.reset(seed=3)[0]] + [b.reset()[0] for _ in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(obs_a, obs_b))
    w = workload("resnet", size="tiny", nodes=1, gpus_per_node=4, global_batch=16)
    a.reset(options={"workload": w})
    assert a.plan_space.workload is w


def test_masked_action_ends_the_episode_with_a_penalty():
    env = ParallelPlanEnv(small_workloads())
    env.reset(seed=0)
    masked = np.flatnonzero(~env.action_masks())
    _, reward, terminated, _, info = env.step(int(masked[0]))
    assert terminated and reward == INVALID_REWARD and info["invalid_action"]


def test_reward_backend_is_pluggable():
    calls = []

    def measured(w, plan):  # stands in for the executor's MeasuredReward
        calls.append(plan)
        return 0.5

    env = ParallelPlanEnv(small_workloads(), reward=measured)
    env.reset(seed=1)
    done, reward, info = False, None, {}
    while not done:
        _, reward, done, _, info = env.step(int(np.flatnonzero(env.action_masks())[0]))
    assert reward == 0.5 and calls == [info["plan"]]


MODELS = [("gpt", "tiny"), ("llama", "tiny"), ("resnet", "tiny"), ("gpt", "gpt2-medium"), ("bert", "bert-large")]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), cluster=st.sampled_from(["cpu", "pcie-4090x8", "dgx-a100-40g"]),
       gpus=st.integers(1, 8), per_gpu=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
@pytest.mark.heavy
def test_masks_allow_exactly_the_fitting_plans(model, cluster, gpus, per_gpu, seed):
    """Every sequence the masks allow is a valid plan that fits; every fitting plan of the
    exhaustive enumeration is reachable through the masks (checked on a sample of each)."""
    family, size = model
    w = workload(family, size=size, cluster=cluster, nodes=1, gpus_per_node=gpus, global_batch=gpus * per_gpu)
    space, rng = PlanSpace(w), np.random.default_rng(seed)
    plans = enumerate_plans(w)
    fits = np.flatnonzero(evaluate(w, plans)["fits"]) if len(plans) else np.zeros(0, dtype=int)
    assert space.step(()).allowed.any() == (len(fits) > 0)
    if not len(fits):
        return
    for _ in range(10):
        prefix = ()
        while len(prefix) < len(space.knobs):
            info = space.step(prefix)
            prefix += (info.values[rng.choice(np.flatnonzero(info.allowed))],)
        plan = space.plan(prefix)
        plan.validate(w)
        assert estimate(w, plan).fits
    for i in rng.choice(fits, size=min(25, len(fits)), replace=False):
        prefix = space.prefix_of(plans.plan(i))
        for s in range(len(space.knobs)):
            info = space.step(prefix[:s])
            assert info.allowed[info.values.index(prefix[s])], (plans.plan(i).describe(), space.names[s])


@pytest.mark.heavy
def test_heldout_set_is_fixed_and_apart_from_training():
    from autopar.envs.workloads import HELDOUT_CLUSTERS, HELDOUT_NODES, TRAIN_NODES, heldout_specs, training_specs

    held = heldout_specs(n=4)
    assert held == heldout_specs(n=4)
    train = training_specs(n=4, seed=1)
    assert not {s.cluster for s in train} & set(HELDOUT_CLUSTERS)
    assert all(s.nodes in (1, *TRAIN_NODES) for s in train)
    trained_sizes = {dict(s.model_args).get("size") for s in train}
    for spec in held:
        assert spec.cluster in HELDOUT_CLUSTERS or spec.nodes in HELDOUT_NODES
        assert len(dict(spec.model_args)) > 2 or dict(spec.model_args)["size"] not in trained_sizes  # custom shape


def test_workload_without_a_fitting_plan_is_refused():
    from autopar.errors import NoValidPlanError

    env = ParallelPlanEnv()
    with pytest.raises(NoValidPlanError):
        env.reset(options={"workload": workload(size="gpt3-13b", cluster="pcie-4090x8", nodes=1, gpus_per_node=1,
                                                global_batch=8)})


def test_heldout_presets_come_from_the_registry_and_share_no_gpu_with_training():
    from autopar.cluster import PRESETS
    from autopar.envs.workloads import HELDOUT_CLUSTERS, HELDOUT_NODES, TRAIN_CLUSTERS, TRAIN_NODES

    trained = {PRESETS[c]["gpu"] for c in TRAIN_CLUSTERS}
    assert HELDOUT_CLUSTERS and not {PRESETS[c]["gpu"] for c in HELDOUT_CLUSTERS} & trained
    assert {"dgx-h200", "gb200-nvl72"} <= set(HELDOUT_CLUSTERS) and "cpu" not in HELDOUT_CLUSTERS
    assert not set(HELDOUT_NODES) & set(TRAIN_NODES)


def test_heldout_of_one_family_and_an_unknown_family():
    from autopar.envs.workloads import heldout_specs

    specs = heldout_specs(n=3, family="vit")
    assert len(specs) == 3 and {s.model for s in specs} == {"vit"}
    with pytest.raises(AutoparError, match="unknown model family 'nope'"):
        heldout_specs(n=1, family="nope")


@pytest.mark.heavy
def test_a_family_without_a_shape_rule_is_trained_and_held_out_by_its_named_sizes(monkeypatch):
    """What a family the zoo adds (MoE) gets without an edit to envs/workloads.py: training on its
    named sizes (not the test ones), held out at other depths and sequence lengths on held-out
    presets or node counts, so no held-out spec is a training spec."""
    import autopar.envs.workloads as W

    monkeypatch.setattr(W, "TRAIN_MODELS", {k: v for k, v in W.TRAIN_MODELS.items() if k != "gpt"})
    monkeypatch.setattr(W, "_heldout_shape", lambda rng, family: W._other_heldout_shape(rng, family))
    W.family_sizes.cache_clear()
    try:
        sizes, seq_lens = W.family_sizes("gpt")
        assert "tiny" not in sizes and "gpt2-small" in sizes and seq_lens == W.OTHER_SEQ_LENS
        train = [W.sample_training_spec(np.random.default_rng(i), "gpt") for i in range(6)]
        held = W.heldout_specs(n=3, family="gpt")
    finally:
        W.family_sizes.cache_clear()
    zoo = W._zoo_sizes("gpt")
    for spec in held:
        args = dict(spec.model_args)
        assert args["layers"] != zoo[args["size"]]["layers"] and args["seq_len"] in W.HELDOUT_SEQ_LENS
        assert spec.cluster in W.HELDOUT_CLUSTERS or spec.nodes in W.HELDOUT_NODES
        assert spec not in train
    assert all(set(dict(s.model_args)) == {"size", "seq_len"} for s in train if s is not None)


def test_the_oracle_cache_key_tells_workloads_of_one_profile_apart():
    """An fp8 workload shares its bf16 profile, and runtime, switches and memory headroom change the
    oracle's answer: each must key its own cached oracle plan (a shared key fed the bf16 plan to the
    fp8 workload's imitation)."""
    import dataclasses

    from autopar.envs.rewards import workload_key

    base = workload(cluster="dgx-h100", size="gpt2-small")
    variants = [dataclasses.replace(base, fp8=True), dataclasses.replace(base, runtime="megatron"),
                dataclasses.replace(base, memory_headroom=0.2), dataclasses.replace(base, global_batch=32)]
    keys = {workload_key(w) for w in [base, *variants]}
    assert len(keys) == 5 and workload_key(base) == workload_key(dataclasses.replace(base))


def test_training_mix_draws_lanes_of_mixed_jobs_at_their_share(monkeypatch):
    """A quarter of the training draws are what the mixed search asks the policy (issue 42): one group's
    GPUs at k grid units of a larger job's batch (the cluster sizing needs the parameter count: a
    stand-in here, so no model is profiled)."""
    import autopar.envs.workloads as W
    from autopar.mixed.shares import quantum

    monkeypatch.setattr(W, "_approx_params", lambda spec: 1e9)
    lanes, whole = [], []
    original = W._as_lane

    def recorded(rng, spec):
        lane = original(rng, spec)
        lanes.append((spec, lane))
        return lane

    monkeypatch.setattr(W, "_as_lane", recorded)
    rng = np.random.default_rng(11)
    drawn = [s for s in (W.sample_training_spec(rng) for _ in range(400)) if s is not None]
    assert 0.15 * len(drawn) < len(lanes) < 0.35 * len(drawn)
    for spec, lane in lanes:
        assert (lane.cluster, lane.nodes, lane.gpus_per_node, lane.model) == (spec.cluster, spec.nodes,
                                                                              spec.gpus_per_node, spec.model)
        jobs = [max(W.MIN_BATCH, round(spec.global_batch * f)) for f in W.LANE_JOB]
        assert any(lane.global_batch % quantum(job) == 0 and lane.global_batch <= job for job in jobs)
        whole.append(lane.global_batch in jobs)
    assert any(whole) and not all(whole)  # the group alone at the job's batch, and shares of it
