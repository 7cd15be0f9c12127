"""Loading a trained policy for planning: fast, without torch, and only if it fits this space.

A policy file is the MaskablePPO zip that training writes, with two entries of autopar's own:
`autopar_meta.json` (env id, space signature, versions, training command, evaluation figures)
and `autopar_actor.npz` (the actor's weights as arrays). Planning needs only the actor, run in
NumPy: importing torch alone takes longer than the whole search budget.
"""

from __future__ import annotations

import io
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np

from autopar.envs.features import space_signature
from autopar.errors import AutoparError
from autopar.schema import POLICY_META_SCHEMA, check, loads

META_ENTRY, ACTOR_ENTRY = "autopar_meta.json", "autopar_actor.npz"
POLICY_FORMAT = "autopar-policy-1"
DEFAULT_POLICY = "default_policy.zip"
REQUIRED_WEIGHTS = tuple(f"{layer}.{part}" for layer in ("features_extractor.context.0", "features_extractor.slots.0",
                                                         "features_extractor.joint.0", "action_net")
                         for part in ("weight", "bias"))


class PolicyError(AutoparError):
    """A policy file is missing, is not an autopar policy, or was trained for another plan space."""


class NumpyActor:
    """The policy's action logits: PlanFeaturesExtractor, then the policy MLP and action layer of
    sb3's ActorCriticPolicy (ReLU activations), on NumPy arrays."""

    def __init__(self, weights: dict[str, np.ndarray], meta: dict):
        self.w = weights
        self.meta = meta
        self.slot_width = weights["features_extractor.slots.0.weight"].shape[1]
        self.context_size = weights["features_extractor.context.0.weight"].shape[1]
        n = 0
        while f"mlp_extractor.policy_net.{2 * n}.weight" in weights:
            n += 1
        self.hidden = [f"mlp_extractor.policy_net.{2 * i}" for i in range(n)]

    def _layer(self, name: str, x: np.ndarray, relu: bool = True) -> np.ndarray:
        y = x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]
        return np.maximum(y, 0.0) if relu else y

    def logits(self, obs: np.ndarray) -> np.ndarray:
        obs = np.atleast_2d(obs).astype(np.float32)
        context = self._layer("features_extractor.context.0", obs[:, :self.context_size])
        slots = obs[:, self.context_size:].reshape(len(obs), -1, self.slot_width)
        slots = self._layer("features_extractor.slots.0", slots).reshape(len(obs), -1)
        h = self._layer("features_extractor.joint.0", np.concatenate([context, slots], axis=1))
        for name in self.hidden:
            h = self._layer(name, h)
        return self._layer("action_net", h, relu=False)

    def probabilities(self, obs: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """Softmax over the allowed actions only (as MaskablePPO's masked distribution)."""
        logits = np.where(masks, self.logits(obs), -np.inf)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)


def default_policy_path() -> Path:
    return Path(str(resources.files("autopar.policies").joinpath(DEFAULT_POLICY)))


def read_meta(path) -> dict:
    """The metadata of a policy file, with the checks that it is one."""
    path = Path(path)
    if not path.is_file():
        raise PolicyError(f"policy file {path} not found; train one with `autopar train cost -o {path.name}` "
                          f"or leave --policy out to use the shipped policy")
    try:
        with zipfile.ZipFile(path) as archive:
            if META_ENTRY not in archive.namelist() or ACTOR_ENTRY not in archive.namelist():
                raise PolicyError(f"{path} is not an autopar policy (no {META_ENTRY} in the archive); "
                                  f"use a policy written by `autopar train`")
            meta = loads(archive.read(META_ENTRY), f"{path}: {META_ENTRY}", PolicyError)
    except (zipfile.BadZipFile, OSError, EOFError):
        raise PolicyError(f"{path} is not an autopar policy (not a zip archive); use a policy written by "
                          f"`autopar train`") from None
    if not isinstance(meta, dict) or meta.get("format") != POLICY_FORMAT:
        raise PolicyError(f"{path}: unknown policy format {meta.get('format') if isinstance(meta, dict) else meta!r}"
                          f"; this autopar reads {POLICY_FORMAT}")
    return check(meta, POLICY_META_SCHEMA, f"{path}: {META_ENTRY}", PolicyError)


def check_signature(meta: dict, path) -> None:
    """Refuse a policy trained for another space: it would read its actions differently."""

    expected = space_signature()
    if meta.get("space_signature") != expected:
        raise PolicyError(f"{path} was trained for plan-space signature {meta.get('space_signature')!r}, but this "
                          f"autopar's space has signature {expected!r}; retrain with `autopar train cost` (or use the "
                          f"autopar version it was trained with)")


def load_policy(path=None) -> NumpyActor:
    """The actor of a policy file (default: the shipped policy), checked against this space."""
    path = Path(path) if path is not None else default_policy_path()
    meta = read_meta(path)
    check_signature(meta, path)
    try:
        with zipfile.ZipFile(path) as archive, np.load(io.BytesIO(archive.read(ACTOR_ENTRY))) as arrays:
            weights = {name: arrays[name] for name in arrays.files}  # allow_pickle=False: arrays only
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise PolicyError(f"{path}: {ACTOR_ENTRY} cannot be read as plain arrays ({e}); re-train the policy") from None
    return checked_actor(weights, meta, path)


def checked_actor(weights: dict, meta: dict, path) -> NumpyActor:
    """The actor, once its arrays are finite float matrices that chain from the observation size to
    the action count the metadata states (a missing, reshaped or foreign weight is refused here,
    not as a NumPy error in the middle of a search)."""
    for name in REQUIRED_WEIGHTS:
        if name not in weights:
            raise PolicyError(f"{path}: the actor has no weight {name!r}; re-train the policy")
    for name, w in weights.items():
        if w.dtype.kind != "f" or w.ndim not in (1, 2) or not np.isfinite(w).all():
            raise PolicyError(f"{path}: actor weight {name!r} must be a finite float vector or matrix, got "
                              f"{w.dtype} of shape {w.shape}; re-train the policy")
    try:
        actor = NumpyActor(weights, meta)
        logits = actor.logits(np.zeros((1, meta.get("observation_size", 0)), dtype=np.float32))
    except (ValueError, KeyError, IndexError) as e:
        raise PolicyError(f"{path}: the actor's weights do not fit together or the observation size "
                          f"({e}); re-train the policy") from None
    if logits.shape != (1, meta.get("max_actions", logits.shape[1])):
        raise PolicyError(f"{path}: the actor gives {logits.shape[1]} action logits but the policy has "
                          f"{meta.get('max_actions')} actions; re-train the policy")
    return actor
