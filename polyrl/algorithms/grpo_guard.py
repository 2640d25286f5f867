"""GRPO-Guard (docs/algorithms.md §3): a bias-corrected, step-normalised log-ratio in the PPO clip, 1/(−dt) weights."""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import AlgorithmBase, PolicyEvaluator, register_algorithm
from .flow_grpo import add_reference_kl, checked_kl_form, old_log_prob, old_mean, ppo_clip_loss, scaled_sq_dist


def guard_log_ratio(log_prob, old_log_prob, mean, old_mean, std) -> torch.Tensor:
    """(Δlog p + b)·s with b = mean_d (μ_θ − μ_old)² / (2s²), s the per-sample transition std.

    For x' = μ_old + s·z this equals mean_d(z ⊙ (μ_θ − μ_old)) exactly: the −Δμ²/(2s²) bias of the
    single-sample log-ratio cancels and the 1/s scale that grows at low noise is removed. With a σ schedule per
    stream (`std` a dict) the bias takes each entry's own s and the scale is the first entry's (the stream whose σ
    the batch stores): one per-sample factor, as the clip needs.
    """
    bias = scaled_sq_dist(mean, old_mean, std)
    scale = next(iter(std.values())) if isinstance(std, dict) else std
    return (log_prob - old_log_prob + bias) * scale


def inverse_dt_weights(sigmas: torch.Tensor, k: int, grid: torch.Tensor) -> torch.Tensor:
    """1/(−dt) of stored step k per sample, normalised by the mean 1/(−dt) over the steps of the sampling grid
    (σ_0 = 1 > … > σ_N = 0). A constant of the run, not a mean over the micro-batch's trained steps: a sample's
    weight must not depend on which samples share its micro-batch (§7)."""
    inv = 1.0 / (sigmas[:, k] - sigmas[:, k + 1])
    return inv / (1.0 / (grid[:-1] - grid[1:])).to(inv).mean()


@register_algorithm("grpo_guard")
class GRPOGuard(AlgorithmBase):
    def __init__(self, clip_range: float = 2e-6, kl_beta: float = 0.0, adv_std: str = "global", adv_clip_max: float = 5.0,
                 kl_form: str = "exact", drop_zero_advantage: bool = False):
        self.clip_range, self.kl_beta, self.adv_std, self.adv_clip_max = clip_range, kl_beta, adv_std, adv_clip_max
        self.kl_form, self.drop_zero_advantage = checked_kl_form(kl_form), drop_zero_advantage

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        out = policy.step(batch, k)
        adv = batch.advantages.to(out.log_prob.device)
        log_ratio = guard_log_ratio(out.log_prob, old_log_prob(batch, k, out.log_prob), out.mean,
                                    old_mean(batch, k, out.mean), out.std)
        weight = inverse_dt_weights(batch.sigmas.to(out.log_prob.device), k, policy.sigma_grid())
        if out.weight is not None:
            weight = weight * out.weight
        loss, ratio, clipped = ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), adv, self.clip_range, weight)
        stats = {"policy_loss": loss.detach(), "clip_frac": clipped.double().mean(), "ratio_mean": ratio.detach().mean(),
                 "ratio_absdev": (ratio.detach() - 1).abs().mean()}
        loss = add_reference_kl(policy, batch, k, out, self.kl_beta, loss, stats, self.kl_form)
        stats["loss"] = loss.detach()
        return loss, stats
