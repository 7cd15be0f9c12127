"""Fine-tuning a planning policy on measured rewards: the executor closes the RL loop.

The space is one workload's plan space restricted to a few values per knob
(`autopar.envs.restricted.RestrictedSpace`: every plan of it is enumerated, so the masks are
exact at every decision and the policy reads the same action slots as on the full space). The
policy starts from the shipped one (trained on the cost model: the prior). Each round proposes
plans (the current policy's beam, then samples from it, then plans drawn uniformly from the rest
of the space so that a round is never empty), measures each distinct plan once through a reward
backend (`autopar.traces.reward.MeasuredReward`: real runs, cached on disk), and fits the
policy to the best measured plans so far (behaviour cloning with `autopar.policies.imitation`:
the best plan weighs most, the next ones keep the search near the good region). The budget is
the number of distinct plans whose measurement the fine-tuning used, whether it was run now or
found in the cache. When it is spent, the policy is fitted to the best measured plan, and its
greedy plan is the pick (measured too when it is not yet, within the budget: one run is kept
for it).

A measured backend here is any callable `plan -> {"reward": float, ...}` with reward minus the
median step time (a failed run: a large negative), as `MeasuredReward` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from rich.console import Console

from autopar.cluster import load_cluster
from autopar.envs.features import workload_features
from autopar.envs.knobs import PlanSpace
from autopar.envs.restricted import RestrictedSpace
from autopar.errors import AutoparError
from autopar.executor.options import RunOptions
from autopar.policies.decode import beam_search, greedy, sample
from autopar.policies.files import numpy_actor
from autopar.policies.imitation import imitate, plan_demonstrations
from autopar.policies.load import check_signature, default_policy_path, read_meta
from autopar.policies.train import TrainConfig, train
from autopar.profile import profile_model
from autopar.traces.measured_cache import default_cache
from autopar.traces.reward import MeasuredReward
from autopar.workload import Workload

ROUND = 8  # plans measured per round
BEAM_SHARE = 0.5  # of a round: from the policy's beam; the rest sampled from it
ELITES = 3  # measured plans the policy is fitted to between rounds
FIT_LR = 1e-3
FIT_EPOCHS = 300  # at most, per fit: fitting stops once the greedy plan is the best measured one
FIT_CHECK = 10  # epochs between those checks


# -- the workload --------------------------------------------------------------------------------
def measured_workload(model: str, model_args: dict, cluster: str, gpus_per_node: int | None, global_batch: int,
                      precision: str = "fp32"):
    """One node of `gpus_per_node` ranks of `cluster` (a preset or cluster JSON)."""
    base = load_cluster(cluster)
    profile = profile_model(model, model_args, dtype=precision)
    return Workload(profile, base.with_nodes(1, gpus_per_node or base.gpus_per_node), global_batch)


# -- fine-tuning ---------------------------------------------------------------------------------
@dataclass
class MeasuredConfig:
    budget: int = 40  # distinct plans whose measurement the fine-tuning may use
    round_size: int = ROUND
    seed: int = 0
    fit_epochs: int = FIT_EPOCHS


@dataclass
class MeasuredLog:
    measured: dict = field(default_factory=dict)  # prefix -> (reward, ran now: bool)
    order: list = field(default_factory=list)  # prefixes in the order they were measured
    source: dict = field(default_factory=dict)  # prefix -> how it was proposed: prior, beam, sample, uniform, pick
    rounds: list = field(default_factory=list)

    @property
    def used(self) -> int:
        return len(self.measured)

    @property
    def runs(self) -> int:
        return sum(1 for _, ran in self.measured.values() if ran)

    def best(self, k: int = 1) -> list[tuple]:
        return sorted(self.measured, key=lambda p: -self.measured[p][0])[:k]


def fit(model, space: PlanSpace, features, log: MeasuredLog, epochs: int, seed: int, elites: int = ELITES) -> float:
    """Behaviour cloning of the best measured plans (the best one weighs most), until the greedy
    plan is the best measured one or `epochs` run out. Returns the loss."""
    top = [p for p in log.best(elites) if log.measured[p][0] > -np.inf]
    weights = [len(top) + 1 - i + (2 if i == 0 else 0) for i in range(len(top))]
    demos = plan_demonstrations(space, features, top, weights)
    for group in model.policy.optimizer.param_groups:
        group["lr"] = FIT_LR
    loss, done = 0.0, 0
    while done < epochs:
        step = min(FIT_CHECK, epochs - done)
        loss = imitate(model, demos, step, seed + done)
        done += step
        if greedy(numpy_actor(model), space, features) == top[0]:
            break
    return loss


def propose(actor, space: RestrictedSpace, features, log: MeasuredLog, k: int, rng, exclude=()) -> list[tuple]:
    """Up to k plans neither measured nor in `exclude`: the policy's beam first, then samples,
    then uniform draws."""
    out: list[tuple] = []
    if k < 1:
        return out

    def add(prefixes, limit, source):
        for p in prefixes:
            if len(out) >= limit:
                return
            if p not in log.measured and p not in out and p not in exclude:
                out.append(p)
                log.source[p] = source

    beam = [d.prefix for d in beam_search(actor, space, features, min(len(space.prefixes), len(log.measured) + k))]
    add(beam, max(1, round(k * BEAM_SHARE)), "beam")
    add([d.prefix for d in sample(actor, space, features, len(space.prefixes), rng, max_draws=16 * k)], k, "sample")
    rest = [p for p in space.prefixes if p not in log.measured and p not in out and p not in exclude]
    add([rest[i] for i in rng.permutation(len(rest))], k, "uniform")
    return out


def finetune(model, space: RestrictedSpace, backend, cfg: MeasuredConfig, say=lambda msg: None) -> dict:
    """Fine-tune `model` (a MaskablePPO, e.g. the shipped policy) on measured rewards within the
    budget. Returns the summary: the pick, the prior's pick, budget used, every measurement."""
    import torch  # heavy: only when fine-tuning

    torch.set_num_threads(1)  # a small network: more threads only contend (with the runs measured, too)
    if cfg.budget < 1:
        raise AutoparError(f"--budget must be at least 1 real run, got {cfg.budget}")
    features = workload_features(space.workload)
    rng = np.random.default_rng(cfg.seed)
    log = MeasuredLog()
    budget = min(cfg.budget, len(space.prefixes))

    def measure(prefix: tuple) -> float:
        out = backend(space.plan(prefix))
        log.measured[prefix] = (float(out["reward"]), not out.get("cached", False))
        log.order.append(prefix)
        return log.measured[prefix][0]

    prior = greedy(numpy_actor(model), space, features)
    # one measurement is kept for the final pick, unless the budget covers the whole space
    stop = max(1, budget - 1) if budget < len(space.prefixes) else budget
    round_ = 0
    while log.used < stop:
        size = min(cfg.round_size, stop - log.used)
        batch = [prior] if not log.measured else []
        log.source.setdefault(prior, "prior")
        batch += propose(numpy_actor(model), space, features, log, size - len(batch), rng, exclude=batch)
        if not batch:
            break
        for p in batch:
            measure(p)
        loss = fit(model, space, features, log, cfg.fit_epochs, cfg.seed + round_)
        best = log.best(1)[0]
        log.rounds.append({"round": round_, "measured": [space.plan(p).describe() for p in batch],
                           "best_s": -log.measured[best][0], "loss": loss})
        say(f"round {round_}: measured {len(batch)} plan(s), {log.used}/{budget} of the budget used; best so far "
            f"{space.plan(best).describe()} at {-log.measured[best][0]:.4f} s")
        round_ += 1
    fit(model, space, features, log, cfg.fit_epochs * 2, cfg.seed + 10_000, elites=1)
    pick = greedy(numpy_actor(model), space, features)
    if pick not in log.measured:
        if log.used >= cfg.budget:  # cannot happen while one run is kept for it; the best measured stands
            pick = log.best(1)[0]
        else:
            log.source[pick] = "pick"
            measure(pick)

    def entry(p: tuple) -> dict:
        return {"plan": space.plan(p).to_dict(), "describe": space.plan(p).describe(),
                "measured_s": -log.measured[p][0] if p in log.measured else None, "source": log.source.get(p)}

    found = log.order.index(log.best(1)[0]) + 1 if log.measured else None
    return {"pick": entry(pick), "prior_pick": entry(prior), "budget": cfg.budget, "budget_used": log.used,
            "best_found_at": found,
            "runs_now": log.runs, "from_cache": log.used - log.runs, "rounds": log.rounds,
            "space": {"plans": len(space.prefixes), "varying": space.varying(), "fixed": space.fixed()},
            "measurements": [entry(p) for p in log.order]}


def train_measured(model: str, model_args: dict, *, cluster: str, gpus_per_node: int | None, global_batch: int,
                   restrict: dict, budget: int, options: RunOptions | None = None, cache: str | None = None,
                   output: str = "policy.zip", seed: int = 0, console=None, backend=None, launcher=None) -> dict:
    """`autopar train measured`: the restricted space of the workload, the shipped policy
    as the start (the cost-model prior), `finetune` within the budget inside `policies.train.train`
    (which loads the start, writes the policy and its sidecar; no PPO on the cost model and no
    imitation of its oracle here). backend: the measured backend (default `MeasuredReward` with
    `options` on the workload's ranks, cached in `cache`, run through `launcher`: default this
    machine, `autopar.traces.launchers`). Returns the metadata; its `measured`
    section is the summary."""
    if budget < 1:
        raise AutoparError(f"--budget must be at least 1 real run, got {budget}")
    console = console or Console()
    workload = measured_workload(model, model_args, cluster, gpus_per_node, global_batch)
    space = RestrictedSpace(workload, restrict)
    console.print(f"{workload.describe()}: restricted space of {len(space.prefixes)} plans", soft_wrap=True)
    options = replace(options or RunOptions(), nproc_per_node=workload.world_size)
    if backend is None:
        backend = MeasuredReward(model, model_args, options, cache_path=cache or default_cache(), cluster=cluster,
                                 launcher=launcher)
    start = default_policy_path()
    check_signature(read_meta(start), start)
    cfg = TrainConfig(timesteps=0, workloads="0", output=output, seed=seed, eval_workloads=0, imitation_epochs=0,
                      dagger_rounds=0)

    def finish(policy_model) -> dict:
        summary = finetune(policy_model, space, backend, MeasuredConfig(budget=budget, seed=seed),
                           say=lambda m: console.print(f"[dim]{m}[/dim]", soft_wrap=True))
        return {"measured": {**summary, "model": model, "model_args": model_args, "cluster": cluster,
                             "workload": workload.describe(), "restrict": {k: list(v) for k, v in restrict.items()},
                             "steps": options.steps, "warmup": options.warmup}}

    return train(cfg, console, pool=[workload], validation=[], start_from=start, finish=finish)
