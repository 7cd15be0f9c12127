"""Fine-tuning a planning policy on measured rewards: the executor closes the RL loop.

The space is one workload's plan space (`autopar.envs.knobs.PlanSpace`) restricted to a few
values per knob (`RestrictedSpace`: every plan of it is enumerated, so the masks are exact at
every decision and the policy reads the same action slots as on the full space). The policy
starts from the shipped one (trained on the cost model: the prior). Each round proposes plans
(the current policy's beam, then samples from it, then plans drawn uniformly from the rest of
the space so that a round is never empty), measures each distinct plan once through a reward
backend (`autopar.executor.reward.MeasuredReward`: real runs, cached on disk), and fits the
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

import time
from dataclasses import dataclass, field

import numpy as np
from autopar.envs.knobs import PlanSpace, StepInfo

from autopar import axes
from autopar.errors import AutoparError
from autopar.knobs import decisions
from autopar.plan import ALIASES


def restrictable() -> tuple[str, ...]:
    """Knobs a restriction may name: the decisions, and the derived degree (dp) they imply."""
    return (axes.derived_axis(),) + tuple(k.name for k in decisions())


# the default restricted space: parallel degrees and micro-batch vary, ZeRO 0/1/3 without offload,
# no / full recompute; the rest fixed (1F1B, no sequence parallelism, fp32 reduction, 25 MB
# buckets, the first mesh order)
DEFAULT_RESTRICT = {"zero": ("0", "1", "3"), "offload_optimizer": ("false",), "recompute": ("none", "full"),
                    "schedule": ("1f1b",), "sequence_parallel": ("false",), "grad_comm_dtype": ("fp32",),
                    "bucket_mb": ("25",), "mesh_order": ("first",)}
MAX_PLANS = 100
ROUND = 8  # plans measured per round
BEAM_SHARE = 0.5  # of a round: from the policy's beam; the rest sampled from it
ELITES = 3  # measured plans the policy is fitted to between rounds
FIT_LR = 1e-3
FIT_EPOCHS = 300  # at most, per fit: fitting stops once the greedy plan is the best measured one
FIT_CHECK = 10  # epochs between those checks


def parse_restrictions(items: list[str] | None, defaults: dict | None = None) -> dict[str, tuple[str, ...]]:
    """`KNOB=V1,V2,...` items over the defaults (`KNOB=*`: every value of that knob)."""
    out = dict(DEFAULT_RESTRICT if defaults is None else defaults)
    for item in items or []:
        knob, sep, values = item.partition("=")
        knob = knob.strip().replace("-", "_")
        knob = ALIASES.get(knob, knob)
        if not sep or not values.strip():
            raise AutoparError(f"--restrict takes KNOB=VALUE[,VALUE...], got {item!r}")
        if knob not in restrictable():
            raise AutoparError(f"--restrict: unknown knob {knob!r}; choose from {', '.join(restrictable())}")
        vals = tuple(v.strip().lower() for v in values.split(",") if v.strip())
        if vals == ("*",):
            out.pop(knob, None)
        else:
            out[knob] = vals
    return out


def label(knob: str, value) -> str:
    """A knob value as `--restrict` spells it: true/false, 25, pp-dp-tp, full:3, interleaved:2."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return "-".join(value)
    if isinstance(value, tuple):
        name, count = value
        return f"{name}:{count}" if name in ("full", "interleaved") else name
    return str(value)


def _matches(knob: str, value, wanted: tuple[str, ...], values: tuple) -> bool:
    """Whether a choice passes a restriction. `first`: the first choice in slot order; recompute
    `full`: every block of the busiest stage (the most blocks among the choices)."""
    text = label(knob, value)
    if "first" in wanted and value == values[0]:
        return True
    if knob == "recompute" and value[0] == "full" and "full" in wanted:
        return value[1] == max(v[1] for v in values if v[0] == "full")
    return text in wanted


class RestrictedSpace(PlanSpace):
    """A workload's plan space with each knob restricted to some values. Every plan of it is
    enumerated on construction (at most `max_plans`), and a choice is allowed when some plan of
    the restricted space continues it: the masks are exact at every decision."""

    def __init__(self, workload, restrict: dict, coeffs=None, max_plans: int = MAX_PLANS):
        super().__init__(workload, coeffs)
        self.restrict = dict(restrict)
        full = PlanSpace(workload, coeffs)
        self.prefixes: list[tuple] = []
        self._next: dict[tuple, set] = {}
        dp = axes.derived_axis()

        def walk(prefix: tuple) -> bool:
            if len(prefix) == len(full.knobs):
                if len(self.prefixes) >= max_plans:
                    raise AutoparError(f"the restricted space has more than {max_plans} plans; restrict more knobs "
                                       f"(--restrict KNOB=VALUES)")
                self.prefixes.append(prefix)
                return True
            info = full.step(prefix)
            knob, found = full.names[len(prefix)], False
            wanted = self.restrict.get(knob)
            for value, ok in zip(info.values, info.allowed):
                if not ok or (wanted is not None and not _matches(knob, value, wanted, info.values)):
                    continue
                implied = full.decided(prefix + (value,)).get(dp)
                if dp in self.restrict and implied is not None and str(implied) not in self.restrict[dp]:
                    continue
                if walk(prefix + (value,)):
                    self._next.setdefault(prefix, set()).add(value)
                    found = True
            return found

        walk(())
        if not self.prefixes:
            raise AutoparError(f"no plan of the restricted space fits {workload.describe()}; relax --restrict")
        self.plans = [self.plan(p) for p in self.prefixes]

    def varying(self) -> dict[str, list[str]]:
        """The knobs that take more than one value across the space, with their values."""
        out = {}
        for s, knob in enumerate(self.names):
            # recompute: "full" is every block of the busiest stage, whatever the count per pp
            vals = list(dict.fromkeys(p[s][0] if knob == "recompute" else label(knob, p[s]) for p in self.prefixes))
            if len(vals) > 1:
                out[knob] = vals
        dp = axes.derived_axis()
        dps = sorted({self.dp_of(p) for p in self.prefixes})
        if len(dps) > 1:
            out = {dp: [str(d) for d in dps], **out}
        return out

    def fixed(self) -> dict[str, str]:
        return {knob: label(knob, self.prefixes[0][s]) for s, knob in enumerate(self.names)
                if len({p[s] for p in self.prefixes}) == 1}

    def _step(self, prefix: tuple) -> StepInfo:
        info = super()._step(prefix)
        nxt = self._next.get(tuple(prefix), set())
        allowed = np.array([ok and v in nxt for v, ok in zip(info.values, info.allowed)], dtype=bool)
        return StepInfo(info.knob, info.values, info.slots, allowed, info.memory, info.time, info.evaluations)


# -- the workload --------------------------------------------------------------------------------
def measured_workload(model: str, model_args: dict, cluster: str, gpus_per_node: int | None, global_batch: int,
                      precision: str = "fp32"):
    """One node of `gpus_per_node` ranks of `cluster` (a preset or cluster JSON)."""
    from autopar.cluster import load_cluster
    from autopar.profile import profile_model
    from autopar.workload import Workload

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


def greedy(actor, space: PlanSpace, features) -> tuple:
    from autopar.policies.decode import beam_search

    return beam_search(actor, space, features, 1)[0].prefix


def demonstrations(space: PlanSpace, features, targets: list[tuple], weights: list[int]):
    """(observations, masks, actions) of the decisions on the way to each target plan, repeated
    by its weight: what `autopar.policies.imitation.imitate` fits."""
    from autopar.envs.features import observation

    obs, masks, actions = [], [], []
    for target, weight in zip(targets, weights):
        prefix = space.advance(())
        while len(prefix) < len(space.knobs):
            info = space.step(prefix)
            value = target[len(prefix)]
            for _ in range(weight):
                obs.append(observation(space, prefix, features))
                masks.append(info.mask())
                actions.append(int(info.slots[info.values.index(value)]))
            prefix = space.advance(prefix + (value,))
    return np.array(obs), np.array(masks), np.array(actions)


def fit(model, space: PlanSpace, features, log: MeasuredLog, epochs: int, seed: int, elites: int = ELITES) -> float:
    """Behaviour cloning of the best measured plans (the best one weighs most), until the greedy
    plan is the best measured one or `epochs` run out. Returns the loss."""
    from autopar.policies.files import numpy_actor
    from autopar.policies.imitation import imitate

    top = [p for p in log.best(elites) if log.measured[p][0] > -np.inf]
    weights = [len(top) + 1 - i + (2 if i == 0 else 0) for i in range(len(top))]
    demos = demonstrations(space, features, top, weights)
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
    from autopar.policies.decode import beam_search, sample

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
    import torch
    from autopar.envs.features import workload_features
    from autopar.policies.files import numpy_actor

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


def measure_all(space: RestrictedSpace, backend, say=lambda msg: None) -> list[dict]:
    """Every plan of the space measured once (the reference; the backend's cache keeps them)."""
    out = []
    for i, (prefix, plan) in enumerate(zip(space.prefixes, space.plans), start=1):
        started = time.perf_counter()
        res = backend(plan)
        record = res.get("record") or {}
        out.append({"plan": plan.to_dict(), "describe": plan.describe(), "reward": float(res["reward"]),
                    "measured_s": -float(res["reward"]) if record.get("outcome", "ok") == "ok" and res["reward"] > -1e3
                    else None, "outcome": record.get("outcome", "ok"), "cached": bool(res.get("cached"))})
        say(f"reference {i}/{len(space.prefixes)}: {plan.describe()}: "
            f"{out[-1]['measured_s'] if out[-1]['measured_s'] is not None else out[-1]['outcome']}"
            f"{' (cached)' if res.get('cached') else ''} [{time.perf_counter() - started:.1f} s]")
    return out


def default_cache() -> str:
    from autopar.profile.cache import cache_dir

    return str(cache_dir() / "measured-rewards.json")


def train_measured(model: str, model_args: dict, *, cluster: str, gpus_per_node: int | None, global_batch: int,
                   restrict: dict, budget: int, steps: int = 20, warmup: int = 3, cache: str | None = None,
                   output: str = "policy.zip", seed: int = 0, console=None, backend=None) -> dict:
    """`autopar train --reward measured`: the restricted space of the workload, the shipped policy
    as the start (the cost-model prior), `finetune` within the budget inside `policies.train.train`
    (which loads the start, writes the policy and its sidecar; no PPO on the cost model and no
    imitation of its oracle here). backend: the measured backend (default `MeasuredReward` on
    gloo, cached in `cache`). Returns the metadata; its `measured` section is the summary."""
    from autopar.policies.load import check_signature, default_policy_path, read_meta
    from autopar.policies.train import TrainConfig, train
    from rich.console import Console

    from autopar.executor.reward import MeasuredReward

    if budget < 1:
        raise AutoparError(f"--budget must be at least 1 real run, got {budget}")
    console = console or Console()
    workload = measured_workload(model, model_args, cluster, gpus_per_node, global_batch)
    space = RestrictedSpace(workload, restrict)
    console.print(f"{workload.describe()}: restricted space of {len(space.prefixes)} plans", soft_wrap=True)
    if backend is None:
        backend = MeasuredReward(model, model_args, steps=steps, warmup=warmup, nproc=workload.world_size,
                                 cache_path=cache or default_cache(), backend="gloo", cluster=cluster)
    start = default_policy_path()
    check_signature(read_meta(start), start)
    cfg = TrainConfig(timesteps=0, workloads="0", output=output, seed=seed, eval_workloads=0, imitation_epochs=0,
                      dagger_rounds=0)

    def finish(policy_model) -> dict:
        summary = finetune(policy_model, space, backend, MeasuredConfig(budget=budget, seed=seed),
                           say=lambda m: console.print(f"[dim]{m}[/dim]", soft_wrap=True))
        return {"measured": {**summary, "model": model, "model_args": model_args, "cluster": cluster,
                             "workload": workload.describe(), "restrict": {k: list(v) for k, v in restrict.items()},
                             "steps": steps, "warmup": warmup}}

    return train(cfg, console, pool=[workload], validation=[], start_from=start, finish=finish)
