"""Training and loading policies: a smoke training run, resume after a kill, the NumPy actor
matching the torch policy, PPO held to what imitation found, and clear errors for files that are
not usable policies."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from autopar.cli import main
from autopar.policies.load import ACTOR_ENTRY, META_ENTRY, POLICY_FORMAT, PolicyError, load_policy

POOL = [{"model": "gpt", "model_args": {"size": "tiny"}, "cluster": "dgx-a100-80g", "gpus_per_node": 4,
         "global_batch": 16},
        {"model": "llama", "model_args": {"size": "tiny"}, "cluster": "pcie-4090x8", "gpus_per_node": 6,
         "global_batch": 24}]
SMALL = ["--timesteps", "384", "--n-steps", "128", "--checkpoint-every", "128", "--eval-workloads", "0"]


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "pool.json"
    path.write_text(json.dumps(POOL))
    return path


@pytest.fixture(scope="module")
def trained(pool_file, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("policy") / "p.zip"
    scratch = tmp_path_factory.mktemp("tmp")  # no SB3 log folder left in the temporary directory
    monkeypatch_module.setattr(tempfile, "tempdir", str(scratch))
    args = ["train", "cost", "--workloads", str(pool_file), "-o", str(out), *SMALL]
    monkeypatch_module.setattr(sys, "argv", ["/usr/bin/autopar", *args])  # as the console script sees it
    assert main(args) == 0
    assert list(scratch.glob("SB3-*")) == []
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.trains
def test_smoke_training_writes_a_policy_with_metadata(trained, pool_file):
    meta = json.loads(trained.with_suffix(".json").read_text())
    assert meta["env_id"] == "autopar/ParallelPlan-v0" and meta["timesteps"] == 384
    assert {"torch", "stable-baselines3", "sb3-contrib", "gymnasium"} <= set(meta["versions"])
    quoted = " ".join(shlex.quote(str(a)) for a in ["cost", "--workloads", pool_file, "-o", trained, *SMALL])
    assert meta["command"] == f"autopar train {quoted}"
    assert load_policy(trained).meta["space_signature"] == meta["space_signature"]
    assert sorted(p.name for p in (trained.parent / "p.zip.ckpt").glob("step_*.zip")) == \
        ["step_128.zip", "step_256.zip", "step_384.zip"]


@pytest.mark.trains
def test_numpy_actor_matches_the_torch_policy(trained, pool_file):
    import torch
    from sb3_contrib import MaskablePPO

    from autopar.envs.parallel_plan_env import ParallelPlanEnv
    from autopar.envs.workloads import WorkloadSpec

    env = ParallelPlanEnv([WorkloadSpec.from_dict(d).build() for d in POOL])
    obs, masks = [], []
    for seed in range(4):
        o, _ = env.reset(seed=seed)
        obs.append(o)
        masks.append(env.action_masks())
    obs, masks = np.array(obs), np.array(masks)
    model = MaskablePPO.load(trained, device="cpu")
    with torch.no_grad():
        dist = model.policy.get_distribution(torch.as_tensor(obs), action_masks=masks)
        expected = dist.distribution.probs.numpy()
    np.testing.assert_allclose(load_policy(trained).probabilities(obs, masks), expected, atol=1e-5)


@pytest.mark.trains
def test_resume_after_a_kill_continues_from_the_last_checkpoint(pool_file, tmp_path, capsys):
    out = tmp_path / "r.zip"
    base = ["train", "cost", "--workloads", str(pool_file), "-o", str(out), "--n-steps", "128",
            "--checkpoint-every", "128", "--eval-workloads", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "autopar", *base, "--timesteps", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline and not list((tmp_path / "r.zip.ckpt").glob("step_256.zip")):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = max(int(p.stem.split("_")[1]) for p in (tmp_path / "r.zip.ckpt").glob("step_*.zip"))
    assert done >= 256 and not out.exists()
    assert main([*base, "--timesteps", str(done + 128), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "resuming from" in printed and f"step_{done}.zip" in printed
    assert json.loads(out.with_suffix(".json").read_text())["timesteps"] == done + 128


def _fake_policy(path, **meta):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(META_ENTRY, json.dumps({"format": POLICY_FORMAT, **meta}))
        archive.writestr(ACTOR_ENTRY, b"")


@pytest.mark.parametrize("kind, message", [
    ("missing", "not found"), ("text", "not a zip archive"), ("empty zip", "is not an autopar policy"),
    ("other space", "trained for plan-space signature 'feedc0de'")])
def test_unusable_policy_files_are_one_line_errors(kind, message, tmp_path, capsys):
    path = tmp_path / "policy.zip"
    if kind == "text":
        path.write_text("not a policy")
    elif kind == "empty zip":
        zipfile.ZipFile(path, "w").close()
    elif kind == "other space":
        _fake_policy(path, space_signature="feedc0de")
    with pytest.raises(PolicyError, match=message):
        load_policy(path)
    assert main(["search", "gpt", "--model-arg", "size=tiny", "--nodes", "1", "--global-batch", "16",
                 "--method", "rl", "--policy", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.trains
def test_resume_never_unpickles_a_checkpoint(trained, pool_file, tmp_path):
    """A checkpoint whose SB3 `data` entry carries a pickle that would run code: --resume reads only
    the weights (weights_only tensors), so the code does not run and training continues."""
    import base64
    import pickle

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    out = tmp_path / "r.zip"
    ckpt = tmp_path / "r.zip.ckpt"
    ckpt.mkdir()
    with zipfile.ZipFile(trained.parent / "p.zip.ckpt" / "step_384.zip") as src, \
            zipfile.ZipFile(ckpt / "step_384.zip", "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "data":
                doc = json.loads(data)
                doc["policy_class"] = {":type:": "<class 'type'>",
                                       ":serialized:": base64.b64encode(pickle.dumps(Payload())).decode()}
                data = json.dumps(doc).encode()
            dst.writestr(item, data)
    (ckpt / ".step_512.zip.abc.tmp").write_bytes(b"half a save")
    assert main(["train", "cost", "--workloads", str(pool_file), "-o", str(out), "--n-steps", "128",
                 "--eval-workloads", "0", "--timesteps", "512", "--resume"]) == 0
    assert not marker.exists() and not list(ckpt.glob(".*.tmp"))
    assert json.loads(out.with_suffix(".json").read_text())["timesteps"] == 512


def test_resume_without_a_checkpoint_and_a_json_output_are_refused(pool_file, tmp_path, capsys):
    assert main(["train", "cost", "--workloads", str(pool_file), "-o", str(tmp_path / "r.zip"), "--resume"]) == 2
    assert main(["train", "cost", "--workloads", str(pool_file), "-o", str(tmp_path / "pol.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "no checkpoint (step_N.zip)" in err[0] and "must not end in .json" in err[1] and len(err) == 2
    assert list(tmp_path.iterdir()) == []


def test_the_shipped_policy_matches_this_space_and_cost_model():
    """Fails when the registry, the action slots or the cost model (source or coefficients) changed
    since the shipped policy was trained: retrain it with RETRAIN_COMMAND."""
    from autopar.policies.fingerprint import RETRAIN_COMMAND, stale
    from autopar.policies.load import default_policy_path, read_meta

    changed = stale(read_meta(default_policy_path()))
    assert changed == [], f"the shipped policy is stale ({', '.join(changed)} changed); retrain: {RETRAIN_COMMAND}"


@pytest.mark.trains
def test_a_policy_trained_on_an_older_cost_model_is_used_with_one_line_said(trained, tmp_path, capsys):
    older = tmp_path / "older.zip"
    with zipfile.ZipFile(trained) as src, zipfile.ZipFile(older, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == META_ENTRY:
                meta = json.loads(data)
                meta["fingerprint"] = {**meta["fingerprint"], "cost": "0123456789abcdef"}
                data = json.dumps(meta).encode()
            dst.writestr(item, data)
    assert main(["search", "gpt", "--model-arg", "size=tiny", "--nodes", "1", "--global-batch", "16",
                 "--method", "rl", "--policy", str(older), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    notes = [line for line in err if line.startswith("note:")]
    assert len(notes) == 1 and "older cost model" in notes[0] and "autopar train" in notes[0]
    assert main(["search", "gpt", "--model-arg", "size=tiny", "--nodes", "1", "--global-batch", "16",
                 "--method", "rl", "--policy", str(trained), "--json"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_the_cost_fingerprint_follows_the_predictions_not_the_source(monkeypatch):
    """Predictions moved by float noise (1e-12 relative, as a refactor or another BLAS may) keep the
    fingerprint; moved by 1% (a real change of the model) they change it, and so does a space that
    enumerates other plans."""
    from autopar import cost
    from autopar.policies import fingerprint

    before = fingerprint.cost_fingerprint()
    real = cost.evaluate

    def scaled(factor):
        def evaluate(*args, **kwargs):
            out = dict(real(*args, **kwargs))
            out["iteration_time"] = out["iteration_time"] * factor
            return out
        return evaluate

    monkeypatch.setattr(cost, "evaluate", scaled(1 + 1e-12))
    assert fingerprint.cost_fingerprint() == before
    monkeypatch.setattr(cost, "evaluate", scaled(1.01))
    assert fingerprint.cost_fingerprint() != before
    monkeypatch.setattr(cost, "evaluate", real)
    enumerate_all = fingerprint.enumerate_plans
    monkeypatch.setattr(fingerprint, "enumerate_plans", lambda w: (s := enumerate_all(w)).take(np.arange(len(s) - 1)))
    assert fingerprint.cost_fingerprint() != before


@pytest.mark.trains
def test_ppo_that_leaves_the_training_plans_worse_keeps_the_imitated_weights(tmp_path, monkeypatch):
    """PPO after imitation is held to the imitated policy on the training workloads: a PPO that wrecks
    the weights (an entropy bonus that flattens every choice) leaves the greedy plans worse, so the
    written policy is the imitated one, weight for weight, and the run says so in one line."""
    import io

    from rich.console import Console

    from autopar.envs.workloads import WorkloadSpec
    from autopar.policies import train as training

    pool = [WorkloadSpec.from_dict(d).build() for d in POOL]

    def run(name: str, timesteps: int):
        cfg = training.TrainConfig(timesteps=timesteps, output=str(tmp_path / name / "p.zip"), n_steps=64,
                                   eval_workloads=0, eval_every=10**6, checkpoint_every=10**6,
                                   imitation_epochs=5, dagger_rounds=1)  # a round of DAgger: imitation that learns
        said = io.StringIO()
        meta = training.train(cfg, Console(file=said, width=400), pool=pool, validation=[])
        return meta, said.getvalue(), load_policy(cfg.output)

    _, _, imitated = run("imitated", 0)  # imitation only
    # a PPO that only spreads the policy out (a huge entropy bonus, no clipping); imitation, which uses
    # neither, is the same as in the first run
    monkeypatch.setitem(training.PPO_SETTINGS, "ent_coef", 100.0)
    monkeypatch.setitem(training.PPO_SETTINGS, "clip_range", 1e3)
    meta, said, kept = run("wrecked", 128)
    assert meta["imitation_kept"] and "the policy keeps the imitated weights" in said, said
    assert meta["timesteps"] == 128
    assert imitated.w.keys() == kept.w.keys()
    for name, value in imitated.w.items():
        np.testing.assert_array_equal(kept.w[name], value, err_msg=name)
