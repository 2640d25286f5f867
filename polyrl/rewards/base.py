"""Reward stage interface: images + prompts + metadata -> scores + extras.

A reward is any callable object registered under a name; `build_reward(cfg)` makes one from the `reward`
config group (`reward.name` picks the class, the other keys are its constructor arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..registry import Registry


@dataclass
class RewardOutput:
    """`scores`: (B,) float32, one per image. `extras`: per-sample diagnostics, name -> length-B list/tensor."""

    scores: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


class Reward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        """`images`: (B, 3, H, W) float in [0, 1] on CPU."""
        ...


REWARDS = Registry("reward")
register_reward = REWARDS.register


def build_reward(cfg: dict) -> Reward:
    cfg = dict(cfg)
    return REWARDS.build(cfg.pop("name"), **cfg)
