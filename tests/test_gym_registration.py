"""Issue 39, point 4: `import autopar` registers `autopar/ParallelPlan-v0` with Gymnasium (a string entry
point: neither torch nor SB3 is imported), so `gym.make` works without importing `autopar.envs`; registering
again does not warn."""

import importlib
import subprocess
import sys
import warnings

import pytest
from gymnasium.envs.registration import registry

import autopar

ENV_ID = "autopar/ParallelPlan-v0"


def test_importing_autopar_registers_the_env_by_a_string_entry_point(monkeypatch):
    monkeypatch.setattr(autopar, "envs", autopar.envs)  # undone after the test, as the two below
    monkeypatch.delitem(sys.modules, "autopar.envs")  # as if nothing had imported it yet
    monkeypatch.delitem(registry, ENV_ID)
    importlib.reload(autopar)
    assert registry[ENV_ID].entry_point == "autopar.envs.parallel_plan_env:ParallelPlanEnv"


def test_registering_again_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(autopar.envs)
        importlib.reload(autopar)
    assert ENV_ID in registry


@pytest.mark.slow
def test_gym_make_after_import_autopar_alone_without_torch_or_sb3_at_import():
    code = ("import sys, autopar, gymnasium as gym\n"
            "assert not [m for m in ('torch', 'stable_baselines3', 'sb3_contrib') if m in sys.modules]\n"
            "obs, _ = gym.make('autopar/ParallelPlan-v0').reset(seed=0)\n"
            "print(obs.shape)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("(") and "Overriding environment" not in done.stderr
