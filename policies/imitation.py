"""Imitation of the exhaustive oracle: behaviour cloning of its plans, then DAgger rounds in which
the best completion (found exhaustively) labels the states the policy's own decisions lead to
(Ross et al. 2011). It gives PPO a starting policy that already plans, instead of chance."""

from __future__ import annotations

import numpy as np

from autopar.envs.features import observation, workload_features
from autopar.envs.knobs import PlanSpace
from autopar.policies.files import numpy_actor

MINIBATCH = 64  # a few thousand demonstrations: small batches, many steps


def demonstrations(pool: list, oracle, actor=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(observations, masks, actions): the expert's decision at each state on the way to a plan.
    Without an actor the way is the expert's own (the oracle's plan); with one it is the actor's
    greedy choices, so the expert (the best completion, found exhaustively) also labels the
    states a policy drifts into, as DAgger does (Ross et al. 2011)."""

    obs, masks, actions = [], [], []
    for w in pool:
        space, features = PlanSpace(w), workload_features(w)
        best = space.prefix_of(oracle.best(w)[1])
        prefix = space.advance(())
        while len(prefix) < len(space.knobs):
            info = space.step(prefix)
            target = best if best[:len(prefix)] == prefix else space.best_completion(prefix)
            o = observation(space, prefix, features)
            obs.append(o)
            masks.append(info.mask())
            actions.append(info.slots[info.values.index(target[len(prefix)])])
            value = target[len(prefix)]
            if actor is not None:
                slot = int(np.argmax(actor.probabilities(o[None], masks[-1][None])[0]))
                value = info.value_at(slot)
            prefix = space.advance(prefix + (value,))
    return np.array(obs), np.array(masks), np.array(actions)


def plan_demonstrations(space, features, targets: list[tuple], weights: list[int]):
    """(observations, masks, actions) of the decisions on the way to each target plan, repeated
    by its weight: what `imitate` fits (measured-reward fine-tuning clones its best plans)."""
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


def imitate(model, demos: tuple, epochs: int, seed: int) -> float:
    """Behaviour cloning: fit the policy to the oracle's decisions (cross-entropy under the masks)
    with the PPO optimizer, so that PPO starts from a planner instead of from chance. Returns the
    final loss."""
    import torch  # torch: heavy, imported on first use

    obs, masks, actions = demos
    rng = np.random.default_rng(seed)
    policy = model.policy
    loss = torch.zeros(())
    for _ in range(epochs):
        for batch in np.array_split(rng.permutation(len(obs)), max(1, len(obs) // MINIBATCH)):
            _, log_prob, _ = policy.evaluate_actions(torch.as_tensor(obs[batch]), torch.as_tensor(actions[batch]),
                                                     action_masks=masks[batch])
            loss = -log_prob.mean()
            policy.optimizer.zero_grad()
            loss.backward()
            policy.optimizer.step()
    return float(loss.detach())


def imitation(model, pool: list, oracle, epochs: int, rounds: int, seed: int, report) -> None:
    """Behaviour cloning of the oracle's plans, then `rounds` DAgger rounds on the policy's own
    decisions (each retrains on everything gathered, for half the epochs). After each round
    `report(round, decisions, loss)` is called."""
    demos = None
    for round_ in range(rounds + 1):
        more = demonstrations(pool, oracle, numpy_actor(model) if round_ else None)
        demos = more if demos is None else tuple(np.concatenate([a, b]) for a, b in zip(demos, more))
        loss = imitate(model, demos, epochs if round_ == 0 else max(1, epochs // 2), seed + round_)
        report(round_, len(demos[0]), loss)
