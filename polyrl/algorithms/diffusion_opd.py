"""DiffusionOPD (docs/algorithms.md §3 on-policy distillation): a frozen teacher replays the student's window states."""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import PolicyEvaluator, register_algorithm, weighted_mean
from .flow_grpo import FlowGRPO, gaussian_mean_kl


def distill_kl(mean: torch.Tensor, teacher_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """mean_d (μ_θ − μ_teacher)² / (2·s²) per sample: the KL from the student's transition to the teacher's."""
    return gaussian_mean_kl(mean, teacher_mean, std)


@register_algorithm("diffusion_opd")
class DiffusionOPD(FlowGRPO):
    """`distill_coef`·distill_kl alone (`policy_gradient: false`) or added to the Flow-GRPO loss."""

    def __init__(self, teacher_path: str, distill_coef: float = 1.0, policy_gradient: bool = False,
                 clip_range: float = 1e-4, kl_beta: float = 0.0, adv_std: str = "global", adv_clip_max: float = 5.0,
                 kl_form: str = "exact", drop_zero_advantage: bool = False):
        super().__init__(clip_range, kl_beta, adv_std, adv_clip_max, kl_form, drop_zero_advantage)
        self.teacher_path, self.distill_coef, self.policy_gradient = teacher_path, distill_coef, policy_gradient

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        out = policy.step(batch, k)
        if self.policy_gradient:
            loss, stats = self.policy_loss(policy, batch, k, out)
        else:
            loss, stats = 0.0, {}
        with torch.no_grad():
            teacher = policy.step(batch, k, policy="teacher")
        kl = weighted_mean(distill_kl(out.mean, teacher.mean, out.std), out.weight)
        stats["distill_kl"] = kl.detach()
        loss = loss + self.distill_coef * kl
        stats["loss"] = loss.detach()
        return loss, stats
