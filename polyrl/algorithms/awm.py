"""AWM, Advantage Weighted Matching (docs/algorithms.md §3; arXiv 2509.25050), as Flow-Factory implements it:
X-GenGroup/Flow-Factory src/flow_factory/trainers/rl/awm.py and hparams/training_args/awm.py at commit
b30dc004982c6b5ce58d79e2163dfc995575aa03 (defaults from there).

The flow-matching loss on the rollout's own clean samples, as a "log-probability" log p = −mean_d (v − (ε − x0))²
(optionally reweighted by σ), in a PPO-clipped surrogate with the group advantage: ρ = exp(log p_θ − log p_old),
ℓ = max(−A·ρ, −A·clip(ρ, 1 + ε_low, 1 + ε_high)). log p_old is the sampling policy's at the same x_σ and ε: on
policy (the default) that is the current weights before the mini-batch's optimizer step, so ρ = 1 in value and the
gradient is −A·∇log p_θ, the advantage-weighted flow-matching gradient; `off_policy: true` samples from the old
(EMA, `actor.ema_decay`) policy and scores log p_old under it.

The velocity is the guided one of the rollout (`rollout.guidance_scale`), as Flow-Factory's forward uses the
training guidance. The σ of a loss term is shared by the update's samples (Flow-Factory: by the step); ε is drawn
per sample and term from keyed streams (§7). Differences from Flow-Factory: `ema_kl_beta` is not offered.
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from ..latents import Latents, at_least_float32, for_entry, sample_mean
from .base import AlgorithmBase, PolicyEvaluator, register_algorithm
from .forward_process import check_clip_range, check_time_range, fresh_noise, noise_to, term_time

WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")


def matching_weighting(log_p: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """Flow-Factory's `apply_matching_weighting` of the per-sample m = −mean_d (v − target)² at noise level σ:
    Uniform m; t σ·m; t**2 σ²·m; huber −(√(−m + 1e-10) − 1e-5)·σ; ghuber −((−m + 1e-10)^p − 1e-10^p)·σ/p."""
    if weighting == "Uniform":
        return log_p
    if weighting == "t":
        return log_p * sigma
    if weighting == "t**2":
        return log_p * sigma**2
    if weighting == "huber":
        return -(torch.sqrt(-log_p + 1e-10) - 1e-5) * sigma
    if weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=log_p.dtype, device=log_p.device)
        return -(torch.pow(-log_p + eps, power) - torch.pow(eps, power)) * sigma / power
    raise ValueError(f"algorithm.weighting={weighting!r}; allowed: {', '.join(WEIGHTINGS)}")


def matching_log_prob(v: Latents, target: Latents, sigma, weighting: str = "Uniform", power: float = 0.25) -> torch.Tensor:
    """Per-sample weighted log p (float64 inside, out in the velocity's dtype, at least float32): each entry's −mean_d (v − target)² weighted with its
    own σ (`sigma` (B,) or one per entry), then the entries' mean weighted by their element counts."""
    total, count = 0.0, 0
    for k in v:
        m = -((v[k].double() - target[k].to(v[k]).double()) ** 2).flatten(1).mean(1)
        d = v[k][0].numel()
        total = total + d * matching_weighting(m, for_entry(sigma, k).to(m), weighting, power)
        count += d
    return at_least_float32((total / count).to(next(iter(v.values())).dtype))


def awm_loss(log_p: torch.Tensor, old_log_p: torch.Tensor, advantages: torch.Tensor, clip_low: float,
             clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ρ = exp(log p − log p_old), ℓ = max(−A·ρ, −A·clip(ρ, 1 + ε_low, 1 + ε_high)) per sample (ε_low < 0, as
    Flow-Factory's clip_range). Returns (ℓ, ρ, clipped-high-or-low mask)."""
    ratio = torch.exp(log_p - old_log_p)
    adv = advantages.to(log_p)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 + clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, (ratio < 1 + clip_low) | (ratio > 1 + clip_high)


@register_algorithm("awm")
class AWM(AlgorithmBase):
    uses_log_probs = False

    def __init__(self, clip_range: tuple = (-1e-4, 1e-4), weighting: str = "Uniform", ghuber_power: float = 0.25,
                 off_policy: bool = False, kl_beta: float = 0.0, num_timesteps: int = 9,
                 timestep_range: tuple = (0.0, 0.9), time_sampling: str = "discrete", adv_std: str = "global",
                 adv_clip_max: float = 5.0):
        self.lo, self.hi = check_time_range(timestep_range, num_timesteps, time_sampling)
        self.clip_low, self.clip_high = check_clip_range(clip_range)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"algorithm.weighting={weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
        if ghuber_power <= 0:
            raise ValueError(f"algorithm.ghuber_power={ghuber_power} must be > 0")
        if kl_beta < 0:
            raise ValueError(f"algorithm.kl_beta={kl_beta} must be >= 0")
        self.weighting, self.ghuber_power, self.kl_beta = weighting, ghuber_power, kl_beta
        self.num_timesteps, self.time_sampling = int(num_timesteps), time_sampling
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max
        self.off_policy = off_policy
        self.needs_old = self.samples_from_old = off_policy  # the EMA copy (actor.ema_decay) samples

    def num_terms(self, batch: Rollout) -> int:
        return self.num_timesteps

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        x0 = batch.final
        t = term_time(self.time_sampling, self.lo, self.hi, k, self.num_timesteps, policy, batch)
        eps = fresh_noise(x0, policy.draws, batch, k)
        t_entry = policy.stream_sigmas(t)
        x_t, target = noise_to(x0, eps, t_entry)
        v = policy.velocity(batch, x_t, t)
        log_p = matching_log_prob(v, target, t_entry, self.weighting, self.ghuber_power)
        if self.off_policy:
            with torch.no_grad():
                old = matching_log_prob(policy.velocity(batch, x_t, t, policy="old"), target, t_entry,
                                        self.weighting, self.ghuber_power)
        else:  # the sampling policy is the current one before this mini-batch's step: the same value, no forward
            old = log_p.detach()
        per_sample, ratio, clipped = awm_loss(log_p, old, batch.advantages.to(log_p.device), self.clip_low,
                                              self.clip_high)
        loss = per_sample.mean()
        stats = {"policy_loss": loss.detach(), "clip_frac": clipped.double().mean(), "ratio_mean": ratio.detach().mean(),
                 "awm/log_p": log_p.detach().mean()}
        if self.kl_beta > 0:
            with torch.no_grad():
                v_ref = policy.velocity(batch, x_t, t, policy="reference")
            kl = sample_mean({n: (v[n] - v_ref[n]) ** 2 for n in v})  # Flow-Factory's v-based KL
            loss = loss + self.kl_beta * kl.mean()
            stats["kl"] = kl.detach().mean()
        stats["loss"] = loss.detach()
        return loss, stats
