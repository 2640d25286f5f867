"""GRPO for token policies (docs/algorithms.md §5): group advantages on sequence rewards (§2), token-level
PPO-clip on the per-token ratio with verl's dual clip (`clip_ratio_c`, 3: for A < 0 the token loss is capped at
−3·A), optional k3 KL to the reference policy.

`loss_agg=seq_mean_token_mean` (the default, GRPO's): each sequence's token mean, then the mean over sequences;
`token_mean`: every token of the mini-batch counts the same (DAPO's, `dapo.py`).
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import register_algorithm
from .token_losses import (
    LOSS_AGGS,
    TokenAlgorithm,
    TokenEvaluator,
    TokenScores,
    aggregate,
    checked_clip_ratio_c,
    k3_kl,
    token_ppo_loss,
    token_stats,
)


@register_algorithm("grpo")
class GRPO(TokenAlgorithm):
    def __init__(self, clip_range: float = 0.2, clip_range_high: float | None = None, kl_beta: float = 0.0,
                 adv_std: str = "group", adv_clip_max: float = 5.0, loss_agg: str = "seq_mean_token_mean",
                 drop_zero_advantage: bool = False, clip_ratio_c: float | None = 3.0):
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"algorithm.loss_agg={loss_agg!r}; allowed: {', '.join(LOSS_AGGS)}")
        self.clip_low = clip_range
        self.clip_high = clip_range if clip_range_high is None else clip_range_high
        self.kl_beta, self.adv_std, self.adv_clip_max = kl_beta, adv_std, adv_clip_max
        self.loss_agg, self.drop_zero_advantage = loss_agg, drop_zero_advantage
        self.clip_ratio_c = checked_clip_ratio_c(clip_ratio_c)

    def loss_weights(self, batch: Rollout) -> torch.Tensor | None:
        return batch.tokens.response_mask.sum(1).float() if self.loss_agg == "token_mean" else None

    def step_loss(self, policy: TokenEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        return self.scores_loss(policy, batch, policy.token_scores(batch))

    def scores_loss(self, policy: TokenEvaluator, batch: Rollout, s: TokenScores) -> tuple[torch.Tensor, dict]:
        """The loss from the current policy's scores `s` (on-policy distillation adds it to its own)."""
        adv = batch.advantages.to(s.log_prob.device)
        loss, ratio, clipped, capped = token_ppo_loss(s.log_prob, s.old_log_prob, adv, s.mask, self.clip_low,
                                                      self.clip_high, s.weight, self.loss_agg, self.clip_ratio_c)
        stats = token_stats(loss, ratio, clipped, s.mask, None if self.clip_ratio_c is None else capped)
        if self.kl_beta > 0:
            with torch.no_grad():
                ref = policy.token_scores(batch, policy="reference").log_prob
            kl = aggregate(k3_kl(s.log_prob, ref), s.mask, s.weight, self.loss_agg)
            stats["kl"] = kl.detach()
            loss = loss + self.kl_beta * kl
        stats["loss"] = loss.detach()
        return loss, stats
