"""GSPO (docs/algorithms.md §5, arXiv 2507.18071): PPO-clip on the sequence ratio s = exp(mean_t (log π_θ −
log π_old)), with the gradient reaching every token (`token_losses.gspo_loss`); ε_low 3e-4, ε_high 4e-4.

No dual clip by default (`clip_ratio_c: null`), as verl's `compute_policy_loss_gspo`, which has none; a number c caps
a sequence's loss at −A·c where A < 0, on the sequence ratio."""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import register_algorithm
from .token_losses import (
    TokenAlgorithm,
    TokenEvaluator,
    TokenScores,
    aggregate,
    checked_clip_ratio_c,
    gspo_loss,
    k3_kl,
    token_stats,
)


@register_algorithm("gspo")
class GSPO(TokenAlgorithm):
    def __init__(self, clip_range: float = 3e-4, clip_range_high: float = 4e-4, kl_beta: float = 0.0,
                 adv_std: str = "group", adv_clip_max: float = 5.0, drop_zero_advantage: bool = False,
                 clip_ratio_c: float | None = None):
        self.clip_low, self.clip_high = clip_range, clip_range_high
        self.kl_beta, self.adv_std, self.adv_clip_max = kl_beta, adv_std, adv_clip_max
        self.drop_zero_advantage = drop_zero_advantage
        self.clip_ratio_c = checked_clip_ratio_c(clip_ratio_c)

    def step_loss(self, policy: TokenEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        return self.scores_loss(policy, batch, policy.token_scores(batch))

    def scores_loss(self, policy: TokenEvaluator, batch: Rollout, s: TokenScores) -> tuple[torch.Tensor, dict]:
        """The loss from the current policy's scores `s` (on-policy distillation adds it to its own)."""
        adv = batch.advantages.to(s.log_prob.device)
        loss, seq_ratio, clipped, capped = gspo_loss(s.log_prob, s.old_log_prob, adv, s.mask, self.clip_low,
                                                     self.clip_high, s.weight, self.clip_ratio_c)
        stats = token_stats(loss, seq_ratio, clipped, s.mask, None if self.clip_ratio_c is None else capped)
        if self.kl_beta > 0:
            with torch.no_grad():
                ref = policy.token_scores(batch, policy="reference").log_prob
            kl = aggregate(k3_kl(s.log_prob, ref), s.mask, s.weight, "seq_mean_token_mean")
            stats["kl"] = kl.detach()
            loss = loss + self.kl_beta * kl
        stats["loss"] = loss.detach()
        return loss, stats
