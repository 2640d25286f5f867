"""Flow-DPPO (docs/algorithms.md §3): drop sample-steps that already moved too far from the old policy, no clip."""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import AlgorithmBase, PolicyEvaluator, register_algorithm, weighted_mean
from .flow_grpo import add_reference_kl, checked_kl_form, gaussian_mean_kl, old_log_prob, old_mean


def dppo_loss(log_prob, old_log_prob, mean, old_mean, std, advantages, tau: float, weight=None):
    """D = mean_d (μ_θ − μ_old)² / (2·s²) with s the transition std (= std·sqrt(−dt) of §3);
    keep = ¬(D ≥ τ ∧ (ρ>1 ∧ A>0 ∨ ρ<1 ∧ A<0)); L = mean_b(keep·(−A·ρ)). Returns (L, ρ, keep, D)."""
    ratio = torch.exp(log_prob - old_log_prob)
    with torch.no_grad():
        div = gaussian_mean_kl(mean, old_mean, std)
        away = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
        keep = ~((div >= tau) & away)
    return weighted_mean(keep.to(ratio) * (-advantages * ratio), weight), ratio, keep, div


@register_algorithm("flow_dppo")
class FlowDPPO(AlgorithmBase):
    def __init__(self, tau: float = 1e-5, kl_beta: float = 0.0, adv_std: str = "global", adv_clip_max: float = 5.0,
                 kl_form: str = "exact", drop_zero_advantage: bool = False):
        self.tau, self.kl_beta, self.adv_std, self.adv_clip_max = tau, kl_beta, adv_std, adv_clip_max
        self.kl_form, self.drop_zero_advantage = checked_kl_form(kl_form), drop_zero_advantage

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        out = policy.step(batch, k)
        adv = batch.advantages.to(out.log_prob.device)
        loss, ratio, keep, div = dppo_loss(out.log_prob, old_log_prob(batch, k, out.log_prob), out.mean,
                                           old_mean(batch, k, out.mean), out.std, adv, self.tau, out.weight)
        stats = {"policy_loss": loss.detach(), "drop_frac": (~keep).double().mean(), "ratio_mean": ratio.detach().mean(),
                 "dppo_div": div.mean()}
        loss = add_reference_kl(policy, batch, k, out, self.kl_beta, loss, stats, self.kl_form)
        stats["loss"] = loss.detach()
        return loss, stats
