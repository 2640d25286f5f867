"""Token policies (docs/algorithms.md §5): the loss math as pure functions, and what a token algorithm declares.

Shapes: per-token tensors are (B, R) over the response positions, `mask` is 1 on real response tokens (the EOS or
stop token included) and 0 on padding; `advantages` are (B,) per sequence (§2, broadcast to its tokens).
A per-token `weight` (rollout correction, §4) multiplies the token's loss; a rejected token (weight 0) still counts
in the denominator, so masking never rescales the loss.

The algorithm classes (`grpo_tokens.py`, `dapo.py`, `gspo.py`, `dpo_tokens.py`) read the current policy's
per-token log-probs through a `TokenEvaluator` (the token actor, `polyrl/actor/tokens.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ..batch import Rollout, TokenBatch
from .base import AlgorithmBase

LOSS_AGGS = ("seq_mean_token_mean", "token_mean")


@dataclass
class TokenScores:
    """Per-token log-probs of a batch's responses under one policy, trimmed to the batch's longest response R'."""

    log_prob: torch.Tensor  # (B, R') log π of each response token (differentiable for the current policy)
    old_log_prob: torch.Tensor  # (B, R') log π_old: the rollout's (bypass) or the old-policy recompute's
    mask: torch.Tensor  # (B, R') float: 1 on response tokens
    weight: torch.Tensor | None = None  # (B, R') rollout-correction weight (§4), None: 1


class TokenEvaluator(Protocol):
    generator: torch.Generator

    def token_scores(self, batch: Rollout, policy: str = "current") -> TokenScores:
        """The batch's response tokens re-scored under `policy` (current | reference | old)."""
        ...

    def response_log_probs(self, batch: Rollout, tokens: TokenBatch, policy: str = "current") -> torch.Tensor:
        """log π of `tokens`' response tokens (B, R') (0 on padding) with the batch's conditioning; e.g. DPO's
        rejected responses."""
        ...

    def sequence_log_probs(self, batch: Rollout, tokens: TokenBatch, policy: str = "current") -> torch.Tensor:
        """Σ_t w_t log π (B,) over each response, w_t its stream's weight (1 for a one-stream policy): DPO's."""
        ...


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None, agg: str) -> torch.Tensor:
    """One loss from per-token values (§5): `seq_mean_token_mean` = mean_b[Σ_t w·m·ℓ / Σ_t m] (GRPO: every sequence
    counts the same), `token_mean` = Σ_{b,t} w·m·ℓ / Σ_{b,t} m (DAPO: every token counts the same)."""
    m = mask.to(per_token)
    wm = m if weight is None else m * weight.to(per_token)
    if agg == "seq_mean_token_mean":
        return (masked_sum(per_token, wm) / m.sum(-1).clamp(min=1)).mean()
    if agg == "token_mean":
        return (per_token * wm).sum() / m.sum().clamp(min=1)
    raise ValueError(f"algorithm.loss_agg={agg!r}; allowed: {', '.join(LOSS_AGGS)}")


def checked_clip_ratio_c(c: float | None) -> float | None:
    """`algorithm.clip_ratio_c` as given, or a one-line ValueError: the dual clip's cap must be > 1 (verl asserts the
    same), or null for no cap."""
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 1):
        raise ValueError(f"algorithm.clip_ratio_c={c!r} must be a number > 1 or null (no dual clip)")
    return None if c is None else float(c)


def dual_clip(per_token: torch.Tensor, adv: torch.Tensor, clip_ratio_c: float | None):
    """Dual-clip PPO (§5; Ye et al. 2020, arXiv 1912.09729; verl's `clip_ratio_c`): where A < 0 the PPO loss
    ℓ = max(−A·ρ, −A·clip(ρ)) is capped at −A·c, ℓ' = min(ℓ, −A·c); where A ≥ 0, ℓ' = ℓ. For A < 0 the cap binds
    exactly where ρ > c (c > 1), and there ℓ' has no gradient: a token the old policy found unlikely and the current
    one likes (ρ > c) cannot drive an unbounded loss. `clip_ratio_c` None: ℓ. Returns (ℓ', capped mask)."""
    if clip_ratio_c is None:
        return per_token, torch.zeros_like(per_token, dtype=torch.bool)
    cap = -adv * clip_ratio_c
    negative = adv < 0
    capped = negative & (per_token > cap)
    return torch.where(negative, torch.minimum(per_token, cap), per_token), capped


def ppo_token_terms(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_low: float,
                    clip_high: float, clip_ratio_c: float | None = None):
    """Per-token PPO-clip terms (§5): ρ_t = exp(log π_θ − log π_old), ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1 − ε_low,
    1 + ε_high)), then the dual clip (`dual_clip`: ℓ_t ← min(ℓ_t, −A·c) where A < 0). `adv` broadcasts against
    the log-probs: (B, 1) per sequence or (B, R) per token. Returns (ℓ, ρ, clipped mask, dual-capped mask)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token, capped = dual_clip(torch.maximum(unclipped, clipped), adv, clip_ratio_c)
    return per_token, ratio, clipped > unclipped, capped


def token_ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   clip_low: float, clip_high: float, weight: torch.Tensor | None = None,
                   agg: str = "seq_mean_token_mean", clip_ratio_c: float | None = None):
    """Token-level PPO-clip (§5 GRPO, DAPO's clip-higher with clip_high > clip_low): ρ_t = exp(log π_θ − log π_old),
    ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1 − ε_low, 1 + ε_high)), for A < 0 capped at −A·c (`clip_ratio_c`; None: no
    cap), aggregated by `agg`. Returns (loss, ρ, clipped mask, dual-capped mask)."""
    per_token, ratio, clipped, capped = ppo_token_terms(log_prob, old_log_prob, advantages.to(log_prob).unsqueeze(-1),
                                                        clip_low, clip_high, clip_ratio_c)
    return aggregate(per_token, mask, weight, agg), ratio, clipped, capped


def gspo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, weight: torch.Tensor | None = None, clip_ratio_c: float | None = None):
    """GSPO (§5, arXiv 2507.18071): the sequence ratio s = exp(mean_t (log π_θ − log π_old)) over the response
    tokens, clipped to [1 − ε_low, 1 + ε_high], ℓ = max(−A·s, −A·clip(s)); with `clip_ratio_c` c, for A < 0 capped at
    −A·c on the sequence ratio (verl's GSPO has no such cap: GSPO's default is None). Each token carries the value s
    through log s_t = log π_θ − sg(log π_θ) + sg(log s), so its gradient reaches every token (∂s_t/∂log π_θ,t = s)
    and the token mean of the gradients is ∇s. Returns (loss, s (B,), clipped (B,), dual-capped (B,))."""
    m = mask.to(log_prob)
    log_s = masked_sum(log_prob - old_log_prob, m) / m.sum(-1).clamp(min=1)
    log_s_token = log_prob - log_prob.detach() + log_s.detach().unsqueeze(-1)
    per_token, _, clipped, capped = ppo_token_terms(log_s_token, torch.zeros_like(log_s_token),
                                                    advantages.to(log_prob).unsqueeze(-1), clip_low, clip_high,
                                                    clip_ratio_c)
    loss = aggregate(per_token, mask, weight, "seq_mean_token_mean")
    real = m.sum(-1) > 0
    return loss, torch.exp(log_s.detach()), clipped.any(-1) & real, capped.any(-1) & real


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate k3 = exp(r) − r − 1 with r = log π_ref − log π_θ (≥ 0, unbiased)."""
    r = ref_log_prob - log_prob
    return torch.exp(r) - r - 1


DPO_LOSSES = ("sigmoid", "ipo")


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float, loss_type: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO / IPO (§5) on sequence log-probs (sums over response tokens): h = (log π_c − log π_r) −
    (log ref_c − log ref_r); DPO L = −log σ(β·h); IPO L = (h − 1/(2β))². Returns (L (B,), β·h (B,))."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h), beta * h
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2, beta * h
    raise ValueError(f"algorithm.loss_type={loss_type!r}; allowed: {', '.join(DPO_LOSSES)}")


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (§5): 0 up to max_len − buffer tokens, then falling linearly to −factor at
    max_len (and below, for longer). `buffer` 0: no penalty."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -factor * torch.clamp(over / buffer, max=1.0)


class TokenAlgorithm(AlgorithmBase):
    """Defaults of every token-policy loss; the actor and trainer read these declarations (docs/tokens.md)."""

    policy_kind = "tokens"
    adv_std = "group"

    def num_terms(self, batch: Rollout) -> int:
        return 1  # one loss over all response tokens of a sample

    def loss_weights(self, batch: Rollout) -> torch.Tensor | None:
        """Per-sample weights the actor normalises mini-batch losses by (None: samples, each micro-batch weighs
        its share of samples); a token-normalised loss returns the response lengths."""
        return None


def token_stats(loss: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor,
                capped: torch.Tensor | None = None) -> dict:
    """The loss's metrics; `dual_clip_frac`: the share of response tokens (GSPO: sequences) the dual clip capped."""
    m = mask.to(ratio).reshape(ratio.shape) if ratio.shape == mask.shape else None
    if m is None:  # sequence-level ratio (GSPO): every sequence counts once
        stats = {"policy_loss": loss.detach(), "clip_frac": clipped.double().mean(), "ratio_mean": ratio.mean(),
                 "ratio_absdev": (ratio - 1).abs().mean()}
        if capped is not None:
            stats["dual_clip_frac"] = capped.double().mean()
        return stats
    n = m.sum().clamp(min=1)
    r = ratio.detach()
    stats = {"policy_loss": loss.detach(), "clip_frac": (clipped.float() * m).sum() / n,
             "ratio_mean": (r * m).sum() / n, "ratio_absdev": ((r - 1).abs() * m).sum() / n}
    if capped is not None:
        stats["dual_clip_frac"] = (capped.float() * m).sum() / n
    return stats
