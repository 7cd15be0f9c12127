"""`gym.make("autopar/ParallelPlan-v0")` with defaults: each reset draws from the zoo's training mix
with the env's own generator, and both Gymnasium's and SB3's env checkers pass on it."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import autopar.envs  # noqa: F401  (registers the env)
from autopar.envs import ENV_ID


@pytest.mark.heavy
def test_made_with_defaults_passes_gymnasiums_checker():
    env = gym.make(ENV_ID)
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs) and info["knob"] is not None
    first = env.unwrapped._workload
    env.reset(seed=3)
    assert env.unwrapped._workload.describe() == first.describe()  # seeded draws repeat


@pytest.mark.heavy
def test_made_with_defaults_passes_sb3s_checker_and_plays_an_episode():
    sb3_checker = pytest.importorskip("stable_baselines3.common.env_checker")
    env = gym.make(ENV_ID).unwrapped
    sb3_checker.check_env(env, warn=True)
    env.reset(seed=0)
    done, reward = False, 0.0
    while not done:
        action = int(np.flatnonzero(env.action_masks())[0])
        _, reward, done, _, info = env.step(action)
    assert reward > -1 and info["plan"].world_size == env._workload.world_size
