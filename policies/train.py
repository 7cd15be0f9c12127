"""Training a planning policy: MaskablePPO on the environment, with progress, evaluation against
the oracle, resumable checkpoints and the metadata that makes a policy file self-describing.

Layout next to the output `policy.zip`: `policy.json` (the metadata sidecar) and
`policy.zip.ckpt/` (`step_<N>.zip` checkpoints, each a usable policy, and `progress.json`).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    track,
)

from autopar.atomic import write_text_atomic
from autopar.envs import ENV_ID
from autopar.envs.features import observation_size, workload_features
from autopar.envs.knobs import MAX_ACTIONS, PlanSpace
from autopar.envs.parallel_plan_env import ParallelPlanEnv
from autopar.envs.rewards import CostModelReward
from autopar.envs.workloads import WorkloadSpec, training_workloads, workload_spec_schema
from autopar.errors import AutoparError
from autopar.policies.decode import beam_search
from autopar.policies.files import latest_checkpoint, numpy_actor, sidecar_path, versions, write_policy
from autopar.policies.fingerprint import fingerprint
from autopar.policies.imitation import imitation
from autopar.policies.load import POLICY_FORMAT
from autopar.schema import MAX_ITEMS, Anything, List, Map, Obj, check, loads, read_file

# fine-tuning settings: a small learning rate and entropy bonus keep PPO from undoing the imitation
PPO_SETTINGS = dict(n_epochs=6, learning_rate=1e-4, gamma=1.0, gae_lambda=0.95, ent_coef=0.002, clip_range=0.2)
MINIBATCH = 256
GUARD_WORKLOADS = 256  # training workloads on which PPO must not leave the greedy plans worse than imitation
NET_ARCH = dict(pi=[128], vf=[128])


@dataclass
class TrainConfig:
    timesteps: int = 100_000
    workloads: str = "1024"  # pool size of the sampler, or a JSON file of WorkloadSpec dicts
    output: str = "policy.zip"
    seed: int = 0
    eval_every: int = 20_000
    eval_workloads: int = 64  # its 5th percentile is a statistic, not the second-worst of 24 workloads
    checkpoint_every: int = 20_000
    resume: bool = False
    n_steps: int = 2048  # environment steps per PPO rollout
    imitation_epochs: int = 50  # behaviour cloning of the oracle's plans before PPO (0: none)
    dagger_rounds: int = 2  # then rounds of labelling the policy's own greedy decisions

    @property
    def checkpoint_dir(self) -> Path:
        return Path(f"{self.output}.ckpt")


# -- workloads ---------------------------------------------------------------------------------------------
def load_pool(spec: str, seed: int, progress: bool) -> list:
    """The training workloads: `spec` is a pool size for the sampler or a JSON file of specs."""

    if spec.isdigit():
        if not 1 <= int(spec) <= MAX_ITEMS:
            raise AutoparError(f"--workloads {spec}: draw between 1 and {MAX_ITEMS} workloads")
        return training_workloads(int(spec), seed=seed, progress=progress)
    items = loads(read_file(spec, "--workloads file", AutoparError), spec, AutoparError)
    items = check(items, List(workload_spec_schema(), max_len=MAX_ITEMS), spec, AutoparError)
    if not items:  # nothing to train on: refused before the policy file is touched
        raise AutoparError(f"--workloads {spec} lists no workloads; give at least one workload spec, or a number of "
                           f"workloads to draw")
    return [WorkloadSpec.from_dict(d).build() for d in items]


def validation_set(pool: list, n: int, seed: int) -> list:
    """n workloads of the training distribution that are not in the pool (another seed)."""

    keys = {(w.profile.digest, w.cluster.name, w.cluster.nodes, w.cluster.gpus_per_node, w.global_batch) for w in pool}
    return [w for w in training_workloads(n + len(pool) // 8, seed=seed + 7919)
            if (w.profile.digest, w.cluster.name, w.cluster.nodes, w.cluster.gpus_per_node, w.global_batch)
            not in keys][:n]


def validation_figures(model, workloads: list, reward) -> dict:
    """Median, 5th percentile and least ratio to the oracle of the greedy plans."""
    ratios = greedy_ratios(numpy_actor(model), workloads, reward)
    return {"timesteps": int(model.num_timesteps), "median": float(np.median(ratios)),
            "p5": float(np.percentile(ratios, 5)), "min": float(ratios.min())}


def greedy_ratios(actor, workloads: list, reward) -> np.ndarray:
    """The ratio to the oracle of the greedy plan of each workload."""

    out = []
    for w in workloads:
        space = PlanSpace(w)
        best = beam_search(actor, space, workload_features(w), 1)[0]
        out.append(reward(w, space.plan(best.prefix)))
    return np.array(out)


# -- training -----------------------------------------------------------------------------------------------
def _callbacks(cfg: TrainConfig, console, validation, reward, history: list, started_steps: int):
    from stable_baselines3.common.callbacks import BaseCallback  # stable_baselines3: heavy, imported on first use

    class Trainer(BaseCallback):
        """Progress bar, periodic evaluation against the oracle, checkpoints."""

        def _on_training_start(self) -> None:
            self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                                     console=console)
            self.progress.start()
            self.task = self.progress.add_task("train", total=cfg.timesteps, completed=started_steps, note="")
            self.rewards: list[float] = []
            self.next_eval = (self.num_timesteps // cfg.eval_every + 1) * cfg.eval_every
            self.next_ckpt = (self.num_timesteps // cfg.checkpoint_every + 1) * cfg.checkpoint_every

        def _on_step(self) -> bool:
            for done, info_reward in zip(self.locals["dones"], self.locals["rewards"]):
                if done:
                    self.rewards = (self.rewards + [float(info_reward)])[-500:]
            if self.num_timesteps % 256 == 0:
                self.progress.update(self.task, completed=self.num_timesteps,
                                     note=f"reward {np.mean(self.rewards or [0]):.3f}" + self._last_eval())
            if self.num_timesteps >= self.next_eval:
                self.next_eval += cfg.eval_every
                if validation:
                    self.evaluate()
            if self.num_timesteps >= self.next_ckpt:
                self.next_ckpt += cfg.checkpoint_every
                self.checkpoint()
            return True

        def _last_eval(self) -> str:
            return f"  val median {history[-1]['median']:.3f}" if history else ""

        def evaluate(self) -> None:
            history.append(validation_figures(self.model, validation, reward))
            self.progress.console.print(f"step {self.num_timesteps:,}: validation ratio to the oracle median "
                                        f"{history[-1]['median']:.3f}, p5 {history[-1]['p5']:.3f}")

        def checkpoint(self) -> None:
            cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            write_policy(self.model, cfg.checkpoint_dir / f"step_{self.num_timesteps}.zip",
                         metadata(cfg, self.model, history))
            write_text_atomic(cfg.checkpoint_dir / "progress.json", json.dumps({"history": history}, indent=1))

        def _on_training_end(self) -> None:
            self.progress.update(self.task, completed=self.num_timesteps)
            self.progress.stop()

    return Trainer()


def metadata(cfg: TrainConfig, model, history: list, seconds: float | None = None) -> dict:
    stamp = fingerprint()
    return {"format": POLICY_FORMAT, "env_id": ENV_ID, "space_signature": stamp["space"], "fingerprint": stamp,
            "observation_size": observation_size(), "max_actions": MAX_ACTIONS, "versions": versions(),
            "command": "autopar train " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["train"]
            else " ".join(shlex.quote(a) for a in sys.argv), "config": asdict(cfg), "ppo": PPO_SETTINGS,
            "net_arch": NET_ARCH, "timesteps": int(model.num_timesteps), "train_seconds": seconds,
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
            "eval": {"validation": history[-1] if history else None, "history": history}}


def train(cfg: TrainConfig, console, *, pool: list | None = None, validation: list | None = None,
          start_from=None, finish=None) -> dict:
    """Train (or resume) and write the policy and its sidecar; returns the metadata.

    pool / validation: the training and validation workloads (default: from `cfg.workloads` and the
    zoo sampler). start_from: a policy file whose weights (and PPO settings) training starts from
    instead of chance, e.g. the shipped policy for fine-tuning; its timestep count restarts at 0.
    finish: `finish(model) -> dict`, called after training; its keys are added to the metadata."""
    import torch  # torch: heavy, imported on first use
    from sb3_contrib import MaskablePPO  # sb3_contrib: heavy, imported on first use
    from stable_baselines3.common.logger import Logger  # stable_baselines3: heavy, imported on first use
    from stable_baselines3.common.monitor import Monitor  # stable_baselines3: heavy, imported on first use
    from stable_baselines3.common.vec_env import DummyVecEnv  # stable_baselines3: heavy, imported on first use
    from torch import nn  # torch: heavy, imported on first use

    from autopar.policies.extractor import PlanFeaturesExtractor  # stable_baselines3, torch

    torch.set_num_threads(1)  # small networks: more threads only contend with the environment
    started = time.perf_counter()
    resume = resume_point(cfg)  # before any work: --resume without a checkpoint is an error
    pool = pool if pool is not None else load_pool(cfg.workloads, cfg.seed, progress=True)
    reward = CostModelReward()

    for w in track(pool, description="oracle for each training workload", console=console, transient=True):
        reward.oracle.time(w)
    if validation is None:
        validation = validation_set(pool, cfg.eval_workloads, cfg.seed) if cfg.eval_workloads else []
    for w in validation:
        reward.oracle.time(w)
    env = DummyVecEnv([lambda: Monitor(ParallelPlanEnv(pool, reward))])
    env.seed(cfg.seed)

    history = read_history(cfg.checkpoint_dir, console) if resume else []
    # Weights and optimizer state come from a policy file through torch's weights_only loading
    # (SB3's set_parameters); MaskablePPO.load would unpickle the file's `data` entry, so a crafted
    # checkpoint could run code.
    model = MaskablePPO("MlpPolicy", env, seed=cfg.seed, device="cpu", verbose=0, n_steps=cfg.n_steps,
                        batch_size=min(MINIBATCH, cfg.n_steps), **PPO_SETTINGS,
                        policy_kwargs=dict(features_extractor_class=PlanFeaturesExtractor,
                                           net_arch=NET_ARCH, activation_fn=nn.ReLU))
    if resume:
        load_weights(model, resume[0])
        model.num_timesteps = resume[1]
        console.print(f"resuming from {resume[0]} ({resume[1]:,} timesteps done)", soft_wrap=True)
    else:
        if start_from is not None:
            load_weights(model, start_from)
            console.print(f"starting from the weights of {start_from}", soft_wrap=True)
        if cfg.imitation_epochs:
            def report(round_: int, decisions: int, loss: float) -> None:
                if validation:
                    history.append(validation_figures(model, validation, reward))
                console.print(f"imitation round {round_}: {decisions:,} expert decisions, loss {loss:.3f}"
                              + (f"; validation median ratio {history[-1]['median']:.3f}, p5 {history[-1]['p5']:.3f}"
                                 if validation else ""))

            with console.status("imitating the oracle (behaviour cloning, then DAgger)"):
                imitation(model, pool, reward.oracle, cfg.imitation_epochs, cfg.dagger_rounds, cfg.seed, report)
    remaining = cfg.timesteps - model.num_timesteps
    # progress goes to the console; SB3's default logger would leave an empty SB3-<date> folder in
    # the temporary directory on every call
    model.set_logger(Logger(folder=None, output_formats=[]))
    # PPO must earn its changes: on the training workloads its greedy plans are held to the imitated
    # policy's, and where they end worse the imitated weights are kept (never judged on `validation`)
    guard = guard_set(pool, cfg.seed) if remaining > 0 and cfg.imitation_epochs and not resume else []
    if guard:
        imitated_ratio, imitated_weights = _mean_ratio(model, guard, reward), _weights(model)
    if remaining > 0:
        model.learn(total_timesteps=remaining, reset_num_timesteps=False,
                    callback=_callbacks(cfg, console, validation, reward, history, model.num_timesteps))
    kept = False
    if guard:
        after = _mean_ratio(model, guard, reward)
        if after < imitated_ratio:
            model.policy.load_state_dict(imitated_weights)
            kept = True
            console.print(f"PPO left the greedy plans of {len(guard)} training workloads worse than imitation did "
                          f"(mean ratio to the oracle {after:.4f}, imitated {imitated_ratio:.4f}): the policy keeps "
                          f"the imitated weights", soft_wrap=True)
    if validation and (kept or not history or history[-1]["timesteps"] != model.num_timesteps):
        history.append(validation_figures(model, validation, reward))
    meta = metadata(cfg, model, history, time.perf_counter() - started)
    meta["imitation_kept"] = kept
    if start_from is not None and not resume:
        meta["started_from"] = str(start_from)
    if finish is not None:
        meta.update(finish(model))
        meta["train_seconds"] = time.perf_counter() - started
    output = Path(cfg.output)
    write_policy(model, output, meta)
    write_text_atomic(sidecar_path(output), json.dumps(meta, indent=1) + "\n")
    return meta


def guard_set(pool: list, seed: int) -> list:
    """Up to GUARD_WORKLOADS of the training workloads (a seeded sample where there are more)."""
    if len(pool) <= GUARD_WORKLOADS:
        return list(pool)
    return [pool[i] for i in sorted(np.random.default_rng(seed).choice(len(pool), GUARD_WORKLOADS, replace=False))]


def _mean_ratio(model, workloads: list, reward) -> float:
    return float(greedy_ratios(numpy_actor(model), workloads, reward).mean())


def _weights(model) -> dict:
    return {name: value.detach().clone() for name, value in model.policy.state_dict().items()}


def resume_point(cfg: TrainConfig) -> tuple[Path, int] | None:
    """The checkpoint --resume continues from; a killed save's temporary files are removed."""
    if not cfg.resume:
        return None
    for stale in cfg.checkpoint_dir.glob(".step_*.zip.*.tmp"):
        stale.unlink(missing_ok=True)
    found = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir.is_dir() else None
    if found is None:
        raise AutoparError(f"--resume: no checkpoint (step_N.zip) in {cfg.checkpoint_dir}; train without --resume "
                           f"to start from scratch")
    return found


def read_history(directory: Path, console) -> list:
    """The evaluation history of a resumed run; a damaged progress.json costs the history only."""

    try:
        data = loads(read_file(directory / "progress.json", "progress file", AutoparError), "progress.json",
                     AutoparError)
        return check(data, Obj({"history": List(Map(Anything()))}, required=("history",)), "progress.json",
                     AutoparError)["history"]
    except AutoparError as e:
        console.print(f"autopar: warning: {e}; the evaluation history restarts", markup=False, soft_wrap=True)
        return []


def load_weights(model, path) -> None:
    """Policy and optimizer state from a policy file, without unpickling (weights_only tensors)."""
    try:
        model.set_parameters(str(path), exact_match=True, device="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line, whatever SB3 raised
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise AutoparError(f"cannot load the weights of {path}: {first}; use a policy or checkpoint written by "
                           f"`autopar train`") from None
