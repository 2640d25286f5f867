"""On-policy distillation for token policies (docs/algorithms.md §5 OPD): a frozen teacher (`teacher_path`) scores
the student's sampled responses, and the per-token reverse KL to it is a dense advantage.

As verl's distillation loss with `use_policy_gradient=true` and `loss_mode=k1` (the Thinking Machines recipe
verl-omni runs for Qwen3-Omni; verl-omni docs/algo/omni_opd.md, commit 0324b39786b2c5586d3747d9633ea8b631fe2183):
k1_t = clamp(log π_θ(y_t) − log π_T(y_t), −c, c), whose mean under the student's samples is the reverse KL
KL(π_θ ‖ π_T); the token advantage −sg(k1_t) enters the token-level PPO-clip loss (§5 GRPO) with verl's dual
clip (`clip_ratio_c`, 3: verl's distillation loss calls its vanilla policy loss, whose default it is). With `task_loss`
grpo or gspo the reward's loss (that algorithm with its own defaults, `task_options` overriding) is added:
L = L_task + `opd_coef`·L_opd; alone (`task_loss: none`) L = `opd_coef`·L_opd and the reward is only logged.

The teacher's forward runs without gradients, through the student's model code (its `forward`, autocast to
`model.dtype`, the rollout's dtype) with the teacher's weights swapped in, at the rollout temperature (verl scores
its teacher at 1; the same at T = 1). A teacher must share the student's tokenizer; it may be larger (a model
directory of the same class) or a polyrl checkpoint of the student.
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import register_algorithm
from .grpo_tokens import GRPO
from .gspo import GSPO
from .token_losses import (
    LOSS_AGGS,
    TokenAlgorithm,
    TokenEvaluator,
    aggregate,
    checked_clip_ratio_c,
    ppo_token_terms,
    token_stats,
)

TASK_LOSSES = ("none", "grpo", "gspo")


def reverse_kl_k1(log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Per-token k1 = log π_θ(y_t) − log π_T(y_t), clamped to [−c, c] (verl's loss_max_clamp; None: unclamped)."""
    k1 = log_prob - teacher_log_prob
    return k1 if clamp is None else k1.clamp(-clamp, clamp)


def dense_ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   clip_low: float, clip_high: float, weight: torch.Tensor | None = None,
                   agg: str = "seq_mean_token_mean", clip_ratio_c: float | None = None):
    """`token_losses.token_ppo_loss` with one advantage per token (B, R) instead of per sequence: ρ_t = exp(log π_θ −
    log π_old), ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high)), capped at −A_t·c where A_t < 0 (the
    dual clip, c = `clip_ratio_c`; None: no cap). Returns (loss, ρ, clipped mask, dual-capped mask)."""
    per_token, ratio, clipped, capped = ppo_token_terms(log_prob, old_log_prob, advantages.to(log_prob), clip_low,
                                                        clip_high, clip_ratio_c)
    return aggregate(per_token, mask, weight, agg), ratio, clipped, capped


def opd_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, mask: torch.Tensor,
             clip_low: float, clip_high: float, clamp: float | None, weight: torch.Tensor | None = None,
             agg: str = "seq_mean_token_mean", clip_ratio_c: float | None = None):
    """Token PPO-clip with the dense advantage A_t = −sg(k1_t): ρ_t = exp(log π_θ − log π_old),
    ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high)), ℓ_t ← min(ℓ_t, −A_t·c) where A_t < 0 (verl's dual
    clip; c = `clip_ratio_c`, None: none), aggregated by `agg`. Returns (loss, ρ, clipped mask, dual-capped mask, k1)."""
    k1 = reverse_kl_k1(log_prob.detach(), teacher_log_prob, clamp)
    loss, ratio, clipped, capped = dense_ppo_loss(log_prob, old_log_prob, -k1, mask, clip_low, clip_high, weight, agg,
                                                  clip_ratio_c)
    return loss, ratio, clipped, capped, k1


@register_algorithm("opd")
class OPD(TokenAlgorithm):
    def __init__(self, teacher_path: str, opd_coef: float = 1.0, task_loss: str = "none", task_options: dict | None = None,
                 clip_range: float = 0.2, clip_range_high: float | None = None, kl_clamp: float | None = 10.0,
                 loss_agg: str = "seq_mean_token_mean", clip_ratio_c: float | None = 3.0):
        if task_loss not in TASK_LOSSES:
            raise ValueError(f"algorithm.task_loss={task_loss!r}; allowed: {', '.join(TASK_LOSSES)}")
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"algorithm.loss_agg={loss_agg!r}; allowed: {', '.join(LOSS_AGGS)}")
        if opd_coef <= 0:
            raise ValueError(f"algorithm.opd_coef={opd_coef} must be > 0")
        if kl_clamp is not None and kl_clamp <= 0:
            raise ValueError(f"algorithm.kl_clamp={kl_clamp} must be > 0 or null (unclamped)")
        if task_options and task_loss == "none":
            raise ValueError("algorithm.task_options is set but algorithm.task_loss=none: name grpo or gspo")
        self.teacher_path, self.opd_coef, self.kl_clamp, self.loss_agg = teacher_path, opd_coef, kl_clamp, loss_agg
        self.clip_ratio_c = checked_clip_ratio_c(clip_ratio_c)
        self.clip_low = clip_range
        self.clip_high = clip_range if clip_range_high is None else clip_range_high
        self.task = None
        if task_loss != "none":
            options = dict(task_options or {})
            cls = {"grpo": GRPO, "gspo": GSPO}[task_loss]
            try:
                self.task = cls(**options)
            except TypeError as e:
                raise ValueError(f"algorithm.task_options for task_loss={task_loss}: {e}") from None
            self.adv_std, self.adv_clip_max = self.task.adv_std, self.task.adv_clip_max
            self.drop_zero_advantage = False  # a flat group still has its distillation signal

    @property
    def needs_reference(self) -> bool:
        return self.task is not None and self.task.needs_reference

    def loss_weights(self, batch: Rollout) -> torch.Tensor | None:
        return batch.tokens.response_mask.sum(1).float() if self.loss_agg == "token_mean" else None

    def step_loss(self, policy: TokenEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        s = policy.token_scores(batch)
        with torch.no_grad():
            teacher = policy.response_log_probs(batch, batch.tokens, policy="teacher").to(s.log_prob)
        loss, ratio, clipped, capped, k1 = opd_loss(s.log_prob, s.old_log_prob, teacher, s.mask, self.clip_low,
                                                    self.clip_high, self.kl_clamp, s.weight, self.loss_agg,
                                                    self.clip_ratio_c)
        capped = None if self.clip_ratio_c is None else capped
        stats = {f"opd/{n}": v for n, v in token_stats(loss, ratio, clipped, s.mask, capped).items()}
        m = s.mask.to(k1)
        stats["opd/reverse_kl"] = (k1 * m).sum() / m.sum().clamp(min=1)  # mean over response tokens
        stats["opd/teacher_log_prob"] = (teacher * m).sum() / m.sum().clamp(min=1)
        loss = self.opd_coef * loss
        if self.task is not None:
            task_loss, task_stats = self.task.scores_loss(policy, batch, s)  # the same forward
            stats.update({n: v for n, v in task_stats.items() if n != "loss"})
            loss = task_loss + loss
        stats["loss"] = loss.detach()
        return loss, stats
