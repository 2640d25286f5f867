"""Reverse steps of a flow-matching sampler with a Gaussian transition density (ALGORITHMS.md §1).

Every function is pure and works per sample: `sigma`, `sigma_next` and `noise_level` are (B,) tensors (or
scalars), so a batch can mix stochastic (SDE-window) and deterministic (ODE) steps. All arithmetic is float32
(the caller's dtype; tests use float64) whatever dtype the network ran in.

A step returns `StepOut(sample, log_prob, mean, std)` where `std` is the standard deviation of the whole
transition x' ~ N(mean, std²) (for `sde` that is a·sqrt(σ/(1−σ̃))·sqrt(−dt)). `log_prob` is the per-element
mean log-density (`mean_d`), which keeps PPO clip ranges of 1e-4…1e-5 meaningful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepOut:
    sample: torch.Tensor
    log_prob: torch.Tensor  # (B,); 0 where the step is deterministic (std = 0)
    mean: torch.Tensor
    std: torch.Tensor  # (B,) transition std


def per_sample(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (B,) value as a (B,) tensor in `like`'s dtype and device."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.expand(like.shape[0]) if t.dim() == 0 else t


def _view(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *([1] * (like.dim() - 1)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """mean_d[ −(x−μ)²/(2s²) − log s − ½ log 2π ] per sample, `std` (B,); 0 where s = 0 (a deterministic step)."""
    std = per_sample(std, x)
    s = _view(torch.where(std > 0, std, torch.ones_like(std)), x)
    lp = (-((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
    return torch.where(std > 0, lp, torch.zeros_like(lp))


def sde_std(sigma: torch.Tensor, noise_level: torch.Tensor, sigma_1: float) -> torch.Tensor:
    """Flow-GRPO noise schedule a·sqrt(σ/(1−σ̃)), σ̃ = σ_1 (the first sigma below 1) where σ = 1."""
    denom = 1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_1), sigma)
    return noise_level * torch.sqrt(sigma / denom)


def sde_step(
    x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level, sigma_1: float,
    noise: torch.Tensor | None = None, prev: torch.Tensor | None = None,
) -> StepOut:
    """Flow-GRPO SDE step (§1 `sde`); with `prev` given, scores that sample instead of drawing one.

    μ = x·(1 + std²·dt/(2σ)) + v·(1 + std²·(1−σ)/(2σ))·dt,  x' = μ + std·sqrt(−dt)·z.  a = 0 is Euler.
    """
    sig, sig_next, a = (per_sample(t, x) for t in (sigma, sigma_next, noise_level))
    std = sde_std(sig, a, sigma_1)
    dt = sig_next - sig
    std_, dt_, sig_ = (_view(t, x) for t in (std, dt, sig))
    mean = x * (1 + std_**2 * dt_ / (2 * sig_)) + v * (1 + std_**2 * (1 - sig_) / (2 * sig_)) * dt_
    scale = std * torch.sqrt(-dt)
    if prev is None:
        z = noise if noise is not None else torch.randn_like(x)
        prev = mean + _view(scale, x) * z
    return StepOut(prev, gaussian_log_prob(prev, mean, scale), mean, scale)


STEPS = {"sde": sde_step}
