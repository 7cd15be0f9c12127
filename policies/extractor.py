"""The features extractor: a context MLP beside one small encoder shared by all action slots.

The observation is [context | MAX_ACTIONS x SLOT_FEATURES] (see `autopar.envs.features`). The
slot encoder applies the same weights to every slot, so what it learns about "a choice with
little memory headroom" or "a choice whose lean completion is 2x slower" holds in every slot;
the joint layer then sees all slots and the context together.
"""

from __future__ import annotations

import torch
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from autopar.envs.features import SLOT_FEATURES
from autopar.envs.knobs import MAX_ACTIONS


class PlanFeaturesExtractor(BaseFeaturesExtractor):
    def __init__(self, observation_space, context_dim: int = 128, slot_dim: int = 8, features_dim: int = 256):
        super().__init__(observation_space, features_dim)
        self.slot_width = len(SLOT_FEATURES)
        self.context_size = observation_space.shape[0] - MAX_ACTIONS * self.slot_width
        self.context = nn.Sequential(nn.Linear(self.context_size, context_dim), nn.ReLU())
        self.slots = nn.Sequential(nn.Linear(self.slot_width, slot_dim), nn.ReLU())
        self.joint = nn.Sequential(nn.Linear(context_dim + MAX_ACTIONS * slot_dim, features_dim), nn.ReLU())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        context = self.context(obs[:, :self.context_size])
        slots = self.slots(obs[:, self.context_size:].reshape(len(obs), MAX_ACTIONS, self.slot_width))
        return self.joint(torch.cat([context, slots.flatten(1)], dim=1))
