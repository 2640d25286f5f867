"""Algorithm interface: advantages from rewards, and a differentiable loss for one trained step.

The actor backend owns the optimisation loop (mini-batches, accumulation over the window, clipping); an
algorithm only says what to minimise, through a `PolicyEvaluator` that re-runs one sampler step under the
current (or reference) weights.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..batch import Rollout
from ..registry import Registry
from ..sampling.steps import StepOut
from .advantage import group_advantages


class PolicyEvaluator(Protocol):
    def step(self, batch: Rollout, k: int, reference: bool = False) -> StepOut:
        """Re-score the stored transition latents[:, k] -> latents[:, k+1] under the current/reference policy."""
        ...


class Algorithm(Protocol):
    needs_reference: bool
    adv_std: str
    adv_clip_max: float

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]: ...


def compute_advantages(algo: Algorithm, batch: Rollout) -> torch.Tensor:
    return group_advantages(batch.rewards, batch.group_ids, algo.adv_std, algo.adv_clip_max)


ALGORITHMS = Registry("algorithm")
register_algorithm = ALGORITHMS.register


def build_algorithm(cfg: dict) -> Algorithm:
    cfg = dict(cfg)
    return ALGORITHMS.build(cfg.pop("name"), **cfg)
