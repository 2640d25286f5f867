"""DAPO (docs/algorithms.md §5, arXiv 2503.14476): GRPO's token-level PPO-clip with

* clip-higher: ε_low = `clip_range` (0.2), ε_high = `clip_range_high` (0.28);
* the dual clip of GRPO (`clip_ratio_c`, 3; verl's default for every PPO-style loss);
* token-level normalisation: every token of the mini-batch counts the same (`loss_agg=token_mean`);
* dynamic sampling (on by default here; a step option any algorithm may turn on, trainer/step.py): a step's groups
  whose rewards are all equal (no signal) are replaced by fresh prompt groups, at most `max_refills` extra rollouts
  per step (logged as `dapo/refills` and `dapo/kept_groups`);
* overlong reward shaping: with `overlong_buffer` L_b > 0, a response longer than max_new_tokens − L_b loses up
  to `overlong_penalty` linearly (`token_losses.overlong_penalty`).
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import register_algorithm
from .grpo_tokens import GRPO
from .token_losses import overlong_penalty


@register_algorithm("dapo")
class DAPO(GRPO):
    dynamic_sampling = True
    max_refills = 3

    def __init__(self, clip_range: float = 0.2, clip_range_high: float | None = 0.28, kl_beta: float = 0.0,
                 adv_std: str = "group", adv_clip_max: float = 5.0, loss_agg: str = "token_mean",
                 overlong_buffer: int = 0, overlong_penalty: float = 1.0, clip_ratio_c: float | None = 3.0):
        super().__init__(clip_range, clip_range_high, kl_beta, adv_std, adv_clip_max, loss_agg,
                         clip_ratio_c=clip_ratio_c)
        if overlong_buffer < 0:
            raise ValueError("algorithm.overlong_buffer must be >= 0")
        self.overlong_buffer, self.overlong_factor = overlong_buffer, overlong_penalty

    def shape_rewards(self, batch: Rollout) -> torch.Tensor:
        if self.overlong_buffer <= 0:
            return batch.rewards
        lengths = batch.tokens.response_mask.sum(1)
        max_len = batch.tokens.response_ids.shape[1]  # a rollout pads its responses to rollout.max_new_tokens
        return batch.rewards + overlong_penalty(lengths, max_len, self.overlong_buffer, self.overlong_factor)
