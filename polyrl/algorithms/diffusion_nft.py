"""DiffusionNFT (docs/algorithms.md §3): likelihood-free, forward-process loss between v⁺ and v⁻ around the old policy.

The rollout runs under the `old` policy (an EMA copy of the trainable weights the actor keeps) with any solver
(an ODE rollout, noise_level 0, the second-order `rollout.step=dpm2`, and guidance 1 are allowed); the loss only
needs the clean latent and the reward.

Two choices of the authors' code (NVlabs/DiffusionNFT at 24af5554, scripts/train_nft_sd3.py) are options here, off
by default: `time_sampling: grid` trains each sample on int(grid_fraction·N) distinct timesteps of the rollout's
own N-step grid (a per-sample permutation, as their `perms_time`; σ = 1 included), instead of `num_timesteps`
uniform t in `timestep_range`; `decay_clock: optimizer_step` evaluates the old-policy decay at the number of
optimizer steps taken so far, after this update's (their `return_decay(global_step)` after each epoch), instead
of at the number of updates before this one.
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from ..latents import entries, for_entry, per_sample, sample_mean
from .base import AlgorithmBase, PolicyEvaluator, latent_shapes, register_algorithm, sample_index, weighted_mean
from .forward_process import term_time


def nft_loss(v_theta, v_old, x_t, x0, t, advantages, adv_clip: float, mix_beta: float) -> tuple[torch.Tensor, dict]:
    """Per-sample L_i = C·[p·mean_d(x̂0⁺−x0)²/w⁺ + (1−p)·mean_d(x̂0⁻−x0)²/w⁻]/β (§3 DiffusionNFT), with
    p = clamp(A, −C, C)/(2C) + ½, v⁺ = β·v_θ + (1−β)·v_old, v⁻ = (1+β)·v_old − β·v_θ, x̂0^± = x_t − t·v^±,
    w^± = stopgrad(max(mean_d |x̂0^± − x0|, 1e-5)). `t` is (B,), or a dict of each entry's own (streams on their own
    σ schedules). Returns (per-sample loss, stats)."""
    c, beta = adv_clip, mix_beta
    v_theta, v_old, x_t, x0 = entries(v_theta), entries(v_old), entries(x_t), entries(x0)
    p = advantages.clamp(-c, c) / (2 * c) + 0.5
    x0_pos, x0_neg = {}, {}
    for k in x0:  # every latent entry; the means below are joint over all of them
        t_ = per_sample(for_entry(t, k), x0[k])
        v_pos = beta * v_theta[k] + (1 - beta) * v_old[k]
        v_neg = (1 + beta) * v_old[k] - beta * v_theta[k]
        x0_pos[k], x0_neg[k] = x_t[k] - t_ * v_pos, x_t[k] - t_ * v_neg
    w_pos = sample_mean({k: (x0_pos[k] - x0[k]).abs() for k in x0}).clamp(min=1e-5).detach()
    w_neg = sample_mean({k: (x0_neg[k] - x0[k]).abs() for k in x0}).clamp(min=1e-5).detach()
    err_pos = sample_mean({k: (x0_pos[k] - x0[k]) ** 2 for k in x0})
    err_neg = sample_mean({k: (x0_neg[k] - x0[k]) ** 2 for k in x0})
    loss = c * (p * err_pos / w_pos + (1 - p) * err_neg / w_neg) / beta
    return loss, {"nft/err_pos": err_pos.detach().mean(), "nft/err_neg": err_neg.detach().mean()}


def old_decay(update: int, decay: float, slope: float, start: int, max_decay: float) -> float:
    """d(update) = clamp(decay + slope·max(update − start, 0), 0, max_decay): copy (0, 0), constant EMA (d, 0),
    or a linear ramp such as d = min(0.0075·(step − 75), 0.999) after step 75 (0, 0.0075, 75, 0.999)."""
    return min(max(decay + slope * max(update - start, 0), 0.0), max_decay)


TIME_SAMPLINGS = ("uniform", "grid", "discrete", "discrete_wo_init")  # the last two: Flow-Factory's (forward_process.py)
DECAY_CLOCKS = ("update", "optimizer_step")


def grid_terms(num_steps: int, fraction: float) -> int:
    """Loss terms per sample of the grid draw: int(fraction·N) (the authors' `num_train_timesteps`; 9 of 10 steps,
    24 of 25 at fraction 0.99)."""
    return int(num_steps * fraction)


def grid_time(grid: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """t (B,) of loss term k of the grid draw: σ_{perm[b, k]} of the grid's step sigmas σ_0 = 1 … σ_{N−1} (σ_N = 0
    is never trained); `perm` (B, N) holds one permutation of range(N) per sample, so the terms of a sample train
    distinct timesteps."""
    return grid[:-1][perm[:, k]]


@register_algorithm("diffusion_nft")
class DiffusionNFT(AlgorithmBase):
    needs_old = True
    samples_from_old = True
    uses_log_probs = False

    def __init__(self, mix_beta: float = 0.1, adv_clip_max: float = 5.0, adv_std: str = "global",
                 num_timesteps: int = 2, timestep_range: tuple = (0.02, 0.98), ref_coef: float = 0.0,
                 decay: float = 0.0, decay_slope: float = 0.0, decay_start: int = 0, decay_max: float = 0.999,
                 time_sampling: str = "uniform", grid_fraction: float = 0.99, decay_clock: str = "update"):
        self.mix_beta, self.adv_clip_max, self.adv_std = mix_beta, adv_clip_max, adv_std
        self.num_timesteps, self.timestep_range, self.ref_coef = num_timesteps, tuple(timestep_range), ref_coef
        self.decay, self.decay_slope, self.decay_start, self.decay_max = decay, decay_slope, decay_start, decay_max
        self.time_sampling, self.grid_fraction, self.decay_clock = time_sampling, grid_fraction, decay_clock
        if not 0 < mix_beta <= 1:
            raise ValueError(f"algorithm.mix_beta={mix_beta} must be in (0, 1]")
        if time_sampling not in TIME_SAMPLINGS:
            raise ValueError(f"algorithm.time_sampling={time_sampling!r}; allowed: {', '.join(TIME_SAMPLINGS)}")
        lo, hi = self.timestep_range
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"algorithm.timestep_range={list(timestep_range)} must be [lo, hi] with 0 <= lo < hi <= 1")
        if not 0 < grid_fraction <= 1:
            raise ValueError(f"algorithm.grid_fraction={grid_fraction} must be in (0, 1]")
        if decay_clock not in DECAY_CLOCKS:
            raise ValueError(f"algorithm.decay_clock={decay_clock!r}; allowed: {', '.join(DECAY_CLOCKS)}")
        self.old_decay_clock = decay_clock

    @property
    def needs_reference(self) -> bool:
        return self.ref_coef > 0

    def num_terms(self, batch: Rollout) -> int:
        return self.num_timesteps

    def num_terms_on(self, batch: Rollout, policy: PolicyEvaluator) -> int:
        if self.time_sampling == "grid":
            return self._grid_terms(policy)
        return self.num_timesteps

    def _grid_terms(self, policy: PolicyEvaluator) -> int:
        n = len(policy.sigma_grid()) - 1
        terms = grid_terms(n, self.grid_fraction)
        if terms < 1:
            raise ValueError(f"algorithm.grid_fraction={self.grid_fraction} of the {n}-step grid trains no timestep "
                             f"(int({self.grid_fraction}·{n}) = 0)")
        return terms

    def old_decay(self, update: int) -> float:
        return old_decay(update, self.decay, self.decay_slope, self.decay_start, self.decay_max)

    def train_time(self, policy: PolicyEvaluator, batch: Rollout, term: int) -> torch.Tensor:
        """t (B,) of loss term `term` on the CPU, keyed by (update, sample, term) (§7): uniform in
        `timestep_range`, or the grid draw (`grid_time`, one permutation per sample for all its terms), or Flow-Factory's
        `discrete` / `discrete_wo_init` (forward_process.py: one σ of the grid per term and update, stratified over
        the steps whose σ lies in [1 − hi, 1 − lo], `timestep_range` read as fractions of the way from noise)."""
        index = sample_index(batch)
        if self.time_sampling == "grid":
            grid = policy.sigma_grid().cpu()
            perm = policy.draws.permutation("nft/grid", index, len(grid) - 1)
            return grid_time(grid, perm, term)
        lo, hi = self.timestep_range
        if self.time_sampling != "uniform":  # Flow-Factory's: one σ per term for the update, range as fractions
            return term_time(self.time_sampling, lo, hi, term, self.num_timesteps, policy, batch).cpu()
        return lo + (hi - lo) * policy.draws.uniform("nft/t", index, term)

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, term: int) -> tuple[torch.Tensor, dict]:
        x0 = batch.final
        device = next(iter(x0.values())).device
        # t and ε keyed by (update, sample, term) (§7), drawn on the CPU (the same on any device), then moved
        index = sample_index(batch)
        t = self.train_time(policy, batch, term).to(device)
        t_entry = policy.stream_sigmas(t)
        noise = policy.draws.normal("nft/eps", index, latent_shapes(x0), term)
        x_t = {}
        for k, v in x0.items():
            t_ = per_sample(for_entry(t_entry, k), v)
            x_t[k] = (1 - t_) * v + t_ * noise[k].to(device)
        with torch.no_grad():
            v_old = policy.velocity(batch, x_t, t, policy="old", guidance=1.0)
        v = policy.velocity(batch, x_t, t, guidance=1.0)
        dev = next(iter(v.values())).device
        t_dev = {k: s.to(dev) for k, s in t_entry.items()} if isinstance(t_entry, dict) else t_entry.to(dev)
        losses, stats = nft_loss(v, v_old, {k: x.to(dev) for k, x in x_t.items()}, {k: x.to(dev) for k, x in x0.items()},
                                 t_dev, batch.advantages.to(dev), self.adv_clip_max, self.mix_beta)
        loss = weighted_mean(losses, None)
        stats["policy_loss"] = loss.detach()
        if self.ref_coef > 0:
            with torch.no_grad():
                v_ref = policy.velocity(batch, x_t, t, policy="reference", guidance=1.0)
            ref_term = sample_mean({k: (v[k] - v_ref[k]) ** 2 for k in v}).mean()
            loss = loss + self.ref_coef * ref_term
            stats["ref_mse"] = ref_term.detach()
        stats["loss"] = loss.detach()
        return loss, stats
