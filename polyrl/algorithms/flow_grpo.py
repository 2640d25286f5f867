"""Flow-GRPO (ALGORITHMS.md §3): PPO-clip on the per-step SDE log-ratio, optional KL to the reference."""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import PolicyEvaluator, register_algorithm


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float):
    """ℓ = max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ = exp(log p_θ − log p_old); returns (mean ℓ, ρ, clipped mask)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio, (clipped > unclipped)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussian transitions of equal std: mean_d (μ_θ − μ_ref)² / (2·std²), per sample.

    `std` is the transition std (for `sde`: a·sqrt(σ/(1−σ̃))·sqrt(−dt)), so this is the exact per-element KL.
    """
    s2 = std.view(-1, *([1] * (mean.dim() - 1))) ** 2
    return ((mean - ref_mean) ** 2 / (2 * s2)).flatten(1).mean(1)


@register_algorithm("flow_grpo")
class FlowGRPO:
    """Loss per trained step k of a mini-batch; the actor averages it over the window and the batch."""

    def __init__(self, clip_range: float = 1e-4, kl_beta: float = 0.0, adv_std: str = "global", adv_clip_max: float = 5.0):
        self.clip_range, self.kl_beta = clip_range, kl_beta
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        out = policy.step(batch, k)
        adv = batch.advantages.to(out.log_prob.device)
        old = batch.log_probs[:, k].to(out.log_prob.device)
        loss, ratio, clipped = ppo_clip_loss(out.log_prob, old, adv, self.clip_range)
        stats = {"policy_loss": loss.detach(), "clip_frac": clipped.float().mean(), "ratio_mean": ratio.detach().mean(),
                 "ratio_absdev": (ratio.detach() - 1).abs().mean()}
        if self.kl_beta > 0:
            with torch.no_grad():
                ref = policy.step(batch, k, reference=True)
            kl = gaussian_mean_kl(out.mean, ref.mean, out.std).mean()
            loss = loss + self.kl_beta * kl
            stats["kl"] = kl.detach()
        stats["loss"] = loss.detach()
        return loss, stats
