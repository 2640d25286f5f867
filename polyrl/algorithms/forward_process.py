"""The forward process the likelihood-free losses train on (docs/algorithms.md §3, notation): training timesteps
and noised latents `x_σ = (1−σ)·x0 + σ·ε` with the flow-matching target `ε − x0`, every latent entry at its own σ.

Time sampling follows Flow-Factory's `TimeSampler` (src/flow_factory/utils/noise_schedule.py, commit
3fe9f760edc4f246723914ab6b8eaaa3d2f7bd43): `timestep_range = [lo, hi]` is a fraction of the way from noise
(σ = 1) to data, and loss term k of T draws from the k-th of T strata, one σ for the whole update (as Flow-Factory
draws one per step). Every draw is keyed (draws.py, §7): the σ by (update, term), ε by (update, sample, term).
"""

from __future__ import annotations

import torch

from ..draws import UpdateDraws
from ..latents import Latents, for_entry, per_sample
from .base import latent_shapes, sample_index

TIME_SAMPLINGS = ("discrete", "discrete_wo_init", "uniform")


def discrete_sigma(grid: torch.Tensor, lo: float, hi: float, k: int, terms: int, u: float,
                   include_init: bool = True) -> float:
    """Flow-Factory's `discrete` strategy: the grid's step sigmas σ_0 … σ_{N−1} (σ_N = 0 excluded) with
    1 − hi ≤ σ_i ≤ 1 − lo span indices [i_min, i_max]; b = linspace(i_min, i_max, T + 1) truncated to integers;
    term k takes index b_k + ⌊u·(b_{k+1} − b_k)⌋ (u ~ U[0, 1)), i.e. stratified over the span. Without
    `include_init` (its `discrete_wo_init`, `TimeSampler.discrete(include_init=False)`) the span starts at
    i_min + 1: the noisiest step of the range is never trained."""
    sig = grid[:-1].double()
    valid = torch.nonzero((sig >= 1 - hi - 1e-6) & (sig <= 1 - lo + 1e-6)).flatten()
    if len(valid) == 0 or (not include_init and len(valid) < 2):
        raise ValueError(f"algorithm.timestep_range=[{lo}, {hi}] holds {'no' if len(valid) == 0 else 'one'} step of "
                         f"the {len(sig)}-step grid (sigmas {[round(float(s), 3) for s in sig]})"
                         + ("" if len(valid) == 0 else ", which time_sampling=discrete_wo_init leaves out"))
    start = int(valid.min()) + (0 if include_init else 1)
    bounds = torch.linspace(start, int(valid.max()), terms + 1, dtype=torch.float64).long()
    lower, upper = int(bounds[k]), int(bounds[k + 1])
    return float(sig[lower + int(u * (upper - lower))])


def uniform_sigma(lo: float, hi: float, k: int, terms: int, u: float) -> float:
    """Flow-Factory's `uniform` strategy (shift 1): the fraction f = lo + (k + u)/T·(hi − lo) of stratum k, σ = 1 − f."""
    return 1.0 - (lo + (k + u) / terms * (hi - lo))


def train_sigma(strategy: str, grid: torch.Tensor, lo: float, hi: float, k: int, terms: int, u: float) -> float:
    """σ of loss term k from a uniform draw u ∈ [0, 1): the strategy's stratum."""
    if strategy in ("discrete", "discrete_wo_init"):
        return discrete_sigma(grid, lo, hi, k, terms, u, include_init=strategy == "discrete")
    if strategy == "uniform":
        return uniform_sigma(lo, hi, k, terms, u)
    raise ValueError(f"algorithm.time_sampling={strategy!r}; allowed: {', '.join(TIME_SAMPLINGS)}")


def term_time(strategy: str, lo: float, hi: float, k: int, terms: int, policy, batch) -> torch.Tensor:
    """t (B,) of loss term k: `train_sigma` on the policy's sampling grid, one σ for every sample of the update
    (its u keyed by the update and the term), on the device of `batch`'s clean latents."""
    u = policy.draws.shared_uniform("forward_process/sigma", k)
    sigma = train_sigma(strategy, policy.sigma_grid(), lo, hi, k, terms, u)
    return torch.full((len(batch),), sigma, device=next(iter(batch.final.values())).device)


def fresh_noise(x0: Latents, draws: UpdateDraws, batch, k: int) -> Latents:
    """ε ~ N(0, I) of loss term k per sample and entry, on the CPU, keyed by (update, sample, term)."""
    return draws.normal("forward_process/eps", sample_index(batch), latent_shapes(x0), k)


def noise_to(x0: Latents, eps: Latents, sigma) -> tuple[Latents, Latents]:
    """(x_σ = (1−σ)·x0 + σ·ε, target ε − x0) per entry; `sigma` is (B,) or one (B,) per entry (stream_sigmas)."""
    x_t, target = {}, {}
    for k, v in x0.items():
        s = per_sample(for_entry(sigma, k).to(v), v)
        x_t[k] = (1 - s) * v + s * eps[k].to(v)
        target[k] = eps[k].to(v) - v
    return x_t, target


def check_time_range(timestep_range, num_timesteps: int, time_sampling: str) -> tuple[float, float]:
    """The validated [lo, hi] (0 ≤ lo < hi ≤ 1); one-line errors naming the key."""
    rng = list(timestep_range) if isinstance(timestep_range, (list, tuple)) else [0.0, timestep_range]
    if len(rng) != 2 or not 0 <= float(rng[0]) < float(rng[1]) <= 1:
        raise ValueError(f"algorithm.timestep_range={timestep_range} must be [lo, hi] (or hi) with 0 <= lo < hi <= 1 "
                         "(fractions of the way from noise to data)")
    if int(num_timesteps) < 1:
        raise ValueError(f"algorithm.num_timesteps={num_timesteps} must be >= 1")
    if time_sampling not in TIME_SAMPLINGS:
        raise ValueError(f"algorithm.time_sampling={time_sampling!r}; allowed: {', '.join(TIME_SAMPLINGS)}")
    return float(rng[0]), float(rng[1])


def check_clip_range(clip_range, ratio: str = "the ratio") -> tuple[float, float]:
    """The validated [low, high] (low ≤ 0 ≤ high) of a ratio clipped to [1 + low, 1 + high]; a one-line error."""
    clip = list(clip_range) if isinstance(clip_range, (list, tuple)) else [clip_range]  # a recipe's scalar too
    if len(clip) != 2 or not float(clip[0]) <= 0 <= float(clip[1]):
        raise ValueError(f"algorithm.clip_range={clip_range} must be [low, high] with low <= 0 <= high "
                         f"({ratio} is clipped to [1 + low, 1 + high])")
    return float(clip[0]), float(clip[1])
