"""Reverse steps of a flow-matching sampler with a Gaussian transition density (docs/algorithms.md §1).

Three steps share one signature (`STEPS`, picked by `rollout.step`; the actor re-scores with the same one); a
fourth, `dpm2` (`dpm2_step`, the second-order multistep DPM-Solver++ ODE solver), carries the previous step's data
prediction and has no log-density, so only likelihood-free algorithms sample with it:

| step | transition std `s` | log-density | PPO clip default |
|---|---|---|---|
| `sde` (Flow-GRPO) | a·sqrt(σ/(1−σ̃))·sqrt(−dt) | Gaussian N(μ, s²), `mean_d` | 1e-4 (1e-5 with windows) |
| `cps` (coefficients-preserving) | σ'·sin(a·π/2) | Gaussian N(μ, s²), `mean_d` | 1e-4, as `sde` |
| `dance` (DanceGRPO, constant η = a) | η·sqrt(−dt) | Gaussian N(μ, s²), `mean_d` | 1e-4, as `sde` |

All three score with the same Gaussian per-element-mean log-density, so a log-ratio means the same thing
(≈ mean_d(z·Δμ)/s) whichever step produced it, and one clip default serves all. (Some CPS code scores with
−mean_d (x'−μ)² instead; that rescales the log-ratio by 2s² and would need a different clip range.)

Every function is pure and works per sample: `sigma`, `sigma_next` and `noise_level` are (B,) tensors (or
scalars), so a batch can mix stochastic (SDE-window) and deterministic (ODE) steps. All arithmetic is float32
(the caller's dtype; tests use float64) whatever dtype the network ran in.

A step returns `StepOut(sample, log_prob, mean, std)` where `std` is the standard deviation of the whole
transition x' ~ N(mean, std²) (for `sde` that is a·sqrt(σ/(1−σ̃))·sqrt(−dt)). `log_prob` is the per-element
mean log-density (`mean_d`), which keeps PPO clip ranges of 1e-4…1e-5 meaningful.

The step functions work on one tensor; `step_latents` applies one to every entry of a `Latents` dict and returns
one joint log-density per sample: the mean over all entries' elements (`latents.sample_mean`). The entries of one
sample share σ and the transition std, except in a model whose streams run their own σ schedules (MiniMax-H3:
video shift 12, audio shift 3): there σ, σ_1, and the returned std and dt are dicts with one value per entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..latents import Latents, for_entry


@dataclass
class StepOut:
    sample: torch.Tensor | Latents
    log_prob: torch.Tensor  # (B,); 0 where the step is deterministic (std = 0)
    mean: torch.Tensor | Latents
    std: torch.Tensor | Latents  # (B,) transition std (one per entry when the streams' σ differ)
    weight: torch.Tensor | None = None  # (B,) rollout-correction weight (IS × rejection mask, §4); None = 1
    dt: torch.Tensor | Latents | None = None  # (B,) σ' − σ (one per entry when the streams' σ differ)
    step: str | None = None  # the step that made it (a `STEPS` key): the flow_grpo KL form depends on it


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
    return StepOut(prev, gaussian_log_prob(prev, mean, scale), mean, scale, step="sde")


def _view_all(x, *ts):
    return (_view(t, x) for t in ts)


def cps_step(
    x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level, sigma_1: float,
    noise: torch.Tensor | None = None, prev: torch.Tensor | None = None,
) -> StepOut:
    """Coefficients-preserving step (§1 `cps`; `sigma_1` unused, kept for the common signature).

    x̂0 = x − σ·v, ε̂ = x + (1−σ)·v, s = σ'·sin(a·π/2), μ = (1−σ')·x̂0 + sqrt(σ'² − s²)·ε̂, x' = μ + s·z.
    Scored with the Gaussian log-density N(μ, s²); a = 0 is the Euler step, σ' = 0 is deterministic.
    """
    sig, sig_next, a = (per_sample(t, x) for t in (sigma, sigma_next, noise_level))
    std = sig_next * torch.sin(a * (math.pi / 2))
    keep = torch.sqrt(torch.clamp(sig_next**2 - std**2, min=0))
    sig_, sig_next_, keep_ = _view_all(x, sig, sig_next, keep)
    x0_hat, eps_hat = x - sig_ * v, x + (1 - sig_) * v
    mean = (1 - sig_next_) * x0_hat + keep_ * eps_hat
    if prev is None:
        z = noise if noise is not None else torch.randn_like(x)
        prev = mean + _view(std, x) * z
    return StepOut(prev, gaussian_log_prob(prev, mean, std), mean, std, step="cps")


def dance_step(
    x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level, sigma_1: float,
    noise: torch.Tensor | None = None, prev: torch.Tensor | None = None,
) -> StepOut:
    """DanceGRPO step with a constant diffusion coefficient η = `noise_level` (§1 `dance`; `sigma_1` unused).

    μ = x + dt·[v + η²/(2σ)·(x + (1−σ)·v)], s = η·sqrt(−dt), x' = μ + s·z, Gaussian log-density. This is the
    `sde` step whose diffusion a·sqrt(σ/(1−σ̃)) is held at η for every σ.
    """
    sig, sig_next, eta = (per_sample(t, x) for t in (sigma, sigma_next, noise_level))
    dt = sig_next - sig
    dt_, sig_, eta_ = _view_all(x, dt, sig, eta)
    mean = x + dt_ * (v + eta_**2 / (2 * sig_) * (x + (1 - sig_) * v))
    std = eta * torch.sqrt(-dt)
    if prev is None:
        z = noise if noise is not None else torch.randn_like(x)
        prev = mean + _view(std, x) * z
    return StepOut(prev, gaussian_log_prob(prev, mean, std), mean, std, step="dance")


STEPS = {"sde": sde_step, "cps": cps_step, "dance": dance_step}


def dpm2_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, sigma_prev=None,
              x0_prev: torch.Tensor | None = None) -> tuple[StepOut, torch.Tensor]:
    """One step of the second-order multistep DPM-Solver++ ODE solver (2M, midpoint form; Lu et al. 2022,
    arXiv 2211.01095) on a flow-matching grid, α = 1 − σ, λ = log(α/σ), data prediction x̂0 = x − σ·v:

        x' = (σ'/σ)·x − c·(x̂0 + ½·r·(x̂0 − x̂0_prev)),  c = α'·(e^(−h) − 1) = α·σ'/σ − α',  r = h/h_prev,

    h = λ' − λ, h_prev = λ − λ_prev. First order (r = 0, the DDIM / Euler step) where there is no previous
    prediction (`x0_prev` None: the first step), at the last step (σ' = 0: diffusers' `lower_order_final`) and
    where σ_prev = 1 (λ_prev = −∞ makes r = 0, as in diffusers' and DiffusionNFT's solver). Deterministic: `std` and
    `log_prob` are 0. Coefficients in float64, arithmetic in x's and v's dtype. Returns (StepOut, x̂0 for the next
    step)."""
    sig, sig_next = per_sample(sigma, x).double(), per_sample(sigma_next, x).double()
    x0 = x - _view(per_sample(sigma, x), x) * v
    alpha, alpha_next = 1 - sig, 1 - sig_next
    c_x = sig_next / sig
    c = alpha * sig_next / sig - alpha_next
    ratio = torch.zeros_like(sig)
    if x0_prev is not None:
        sig_prev = per_sample(sigma_prev, x).double()
        second = (sig_next > 0) & (sig_prev < 1)
        safe = lambda t: torch.where(second, t, torch.full_like(t, 0.5))  # noqa: E731 (λ of the rows kept only)
        lam = lambda t: torch.log(1 - t) - torch.log(t)  # noqa: E731
        h = lam(safe(sig_next)) - lam(safe(sig))
        h_prev = lam(safe(sig)) - lam(torch.where(second, sig_prev, torch.full_like(sig_prev, 0.25)))
        ratio = torch.where(second, h / h_prev, ratio)
    dtype = torch.promote_types(x.dtype, v.dtype)  # a float32 initial state with a float64 network's velocity
    c_x, c, ratio = (_view(t.to(dtype), x) for t in (c_x, c, ratio))
    d = x0 if x0_prev is None else x0 + 0.5 * ratio * (x0 - x0_prev)
    sample = c_x * x - c * d
    zero = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    return StepOut(sample, zero, sample, zero, step="dpm2"), x0


ODE_STEPS = ("dpm2",)  # multistep ODE solvers: no log-density, so likelihood-free algorithms only
ROLLOUT_STEPS = (*STEPS, *ODE_STEPS)  # what `rollout.step` takes


def dpm2_latents(x: Latents, v: Latents, sigma, sigma_next, sigma_prev, x0_prev: Latents | None
                 ) -> tuple[StepOut, Latents]:
    """`dpm2_step` on every entry of `x` (σ's shared, or one per entry: `DiffusionPolicy.stream_sigmas`); returns
    (StepOut with log_prob 0, each entry's x̂0)."""
    outs = {k: dpm2_step(x[k], v[k], for_entry(sigma, k), for_entry(sigma_next, k),
                         None if sigma_prev is None else for_entry(sigma_prev, k),
                         None if x0_prev is None else x0_prev[k]) for k in x}
    first = next(iter(outs.values()))[0]
    sample = {k: o.sample for k, (o, _) in outs.items()}
    return (StepOut(sample, first.log_prob, sample, first.std, step="dpm2"),
            {k: x0 for k, (_, x0) in outs.items()})


def squared_distance_log_prob(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """−mean_d (x − μ)² per sample: the score flow_grpo and verl-omni give `cps` steps (docs/algorithms.md §3, convention
    (b)). It is the Gaussian log-density × 2s² up to a constant, so its log-ratios are 2s² times the Gaussian ones
    and a clip range means something else (0.7 … 12,500× on the SD3 10-step grid)."""
    return -((x - mean) ** 2).flatten(1).mean(1)


LOG_DENSITIES = ("gaussian", "squared_distance")


def step_latents(step_fn, x: Latents, v: Latents, sigma, sigma_next, noise_level, sigma_1,
                 noise: Latents | None = None, prev: Latents | None = None, log_density: str = "gaussian") -> StepOut:
    """`step_fn` applied to every entry of `x`; `sample` and `mean` are Latents and `log_prob` is the joint
    per-element mean over all entries, Σ_e D_e·lp_e / Σ_e D_e (§1). `sigma`, `sigma_next` and `sigma_1` are shared
    by all entries, or dicts with one value per entry (`DiffusionPolicy.stream_sigmas`; then `std` and `dt` come back
    as dicts too). `log_density` "squared_distance" scores each transition with −mean_d (x' − μ)² instead
    (`squared_distance_log_prob`)."""
    if log_density not in LOG_DENSITIES:
        raise ValueError(f"rollout.log_density={log_density!r}; allowed: {', '.join(LOG_DENSITIES)}")
    outs = {k: step_fn(x[k], v[k], for_entry(sigma, k), for_entry(sigma_next, k), noise_level, for_entry(sigma_1, k),
                       noise=None if noise is None else noise[k], prev=None if prev is None else prev[k]) for k in x}
    if log_density == "squared_distance":
        for o in outs.values():
            o.log_prob = squared_distance_log_prob(o.sample, o.mean)
    first = next(iter(outs.values()))
    if len(outs) == 1:
        log_prob = first.log_prob
    else:
        sizes = {k: x[k][0].numel() for k in x}
        log_prob = sum(o.log_prob * sizes[k] for k, o in outs.items()) / sum(sizes.values())
    if isinstance(sigma, dict):
        std = {k: o.std for k, o in outs.items()}
        dt = {k: per_sample(sigma_next[k], o.std) - per_sample(sigma[k], o.std) for k, o in outs.items()}
    else:
        std, dt = first.std, per_sample(sigma_next, first.std) - per_sample(sigma, first.std)
    return StepOut({k: o.sample for k, o in outs.items()}, log_prob, {k: o.mean for k, o in outs.items()}, std,
                   dt=dt, step=first.step)
