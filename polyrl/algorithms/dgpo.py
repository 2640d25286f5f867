"""DGPO, Direct Group Preference Optimization (docs/algorithms.md §3; ICLR 2026), as Flow-Factory implements it:
X-GenGroup/Flow-Factory src/flow_factory/trainers/rl/dgpo.py and hparams/training_args/dgpo.py at commit
b30dc004982c6b5ce58d79e2163dfc995575aa03 (defaults from there).

Likelihood-free: the rollout keeps only the clean latents and the rewards (any solver, the ODE included). Each loss
term noises every sample at one σ shared by the batch, with one ε shared by each prompt group; the per-sample
denoising error e = mean_d (v − (ε − x0))² is weighted by its advantage and by a group weight
σ(Σ_group A·β·(e − e_ref)/G), a DPO-style preference of the whole group over the reference; a PPO-style mask
against the old (EMA) policy stops the gradient of samples that already moved past the clip range.

The shared σ is drawn per update and term, the group noise per prompt group (keyed by the update and the group's
id, §7), as Flow-Factory draws them per step and seeds them per group. Differences from Flow-Factory: every
micro-batch holds whole groups (`whole_groups`), and one data-parallel rank (Flow-Factory
all-reduces partial group sums); the rollout always samples from the current policy (Flow-Factory switches to the
EMA after `switch_ema_ref` = 200 optimizer steps); `kl_cfg` (a guided reference) is not offered.
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from ..draws import UpdateDraws
from ..latents import Latents, sample_mean
from .base import AlgorithmBase, PolicyEvaluator, latent_shapes, register_algorithm, weighted_mean
from .forward_process import check_clip_range, check_time_range, fresh_noise, noise_to, term_time


def dsm_error(v: Latents, target: Latents) -> torch.Tensor:
    """Per-sample denoising (flow-matching) error e = mean_d (v − target)², joint over every latent entry."""
    return sample_mean({k: (v[k] - target[k].to(v[k])) ** 2 for k in v})


def dgpo_clip_mask(err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                   clip_high: float) -> torch.Tensor:
    """Flow-Factory's DSM clip: ρ = exp(e_old − sg(e)); clipped where A > 0 and ρ > 1 + ε_high, or A ≤ 0 and
    ρ < 1 + ε_low (ε_low < 0). Returns a bool (B,)."""
    ratio = torch.exp(old_err - err.detach())
    return torch.where(advantages > 0, ratio > 1 + clip_high, ratio < 1 + clip_low)


def group_preference_weights(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor,
                             group_ids: torch.Tensor, beta: float) -> torch.Tensor:
    """w_i = σ(s_g(i)) with s_g = Σ_{j∈g} A_j·β·(e_j − e_ref,j)/G_g, G_g the group's size; no gradient."""
    err, ref_err, adv = err.detach(), ref_err.detach(), advantages.to(err)
    _, inverse, counts = torch.unique(group_ids.to(err.device), return_inverse=True, return_counts=True)
    contrib = adv * beta * (err - ref_err) / counts[inverse].to(err)
    sums = torch.zeros(len(counts), dtype=err.dtype, device=err.device).scatter_add_(0, inverse, contrib)
    return torch.sigmoid(sums)[inverse]


def dgpo_loss(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
              beta: float, clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ℓ_i = w_i·A_i·e_i (mean over samples: the DGPO loss); e_i's gradient is stopped where `clip`.
    Returns (ℓ, w)."""
    w = group_preference_weights(err, ref_err, advantages, group_ids, beta)
    e = err if clip is None else torch.where(clip, err.detach(), err)
    return w * advantages.to(err) * e, w


def ema_ref_decay(step: int, ramp_rate: float, max_decay: float) -> float:
    """Flow-Factory's old-policy EMA: d = min(max_decay, ramp_rate·step) after optimizer step `step` (0-based)."""
    return min(max_decay, ramp_rate * step)


def group_noise(x0: Latents, group_ids: torch.Tensor, draws: UpdateDraws) -> Latents:
    """One ε per prompt group and entry, keyed by the update and the group's id (the same for every loss term);
    every sample of the group gets it."""
    groups, inverse = torch.unique(group_ids.cpu(), return_inverse=True)
    eps = draws.normal("dgpo/group_eps", groups, latent_shapes(x0))
    return {k: v[inverse] for k, v in eps.items()}


@register_algorithm("dgpo")
class DGPO(AlgorithmBase):
    uses_log_probs = False
    whole_groups = True
    old_every_optimizer_step = True

    def __init__(self, beta: float = 100.0, clip_range: tuple = (-1e-4, 1e-4), clip_dsm: bool = True,
                 clip_kl: bool = False, use_ema_ref: bool = False, shared_noise: bool = True, kl_beta: float = 0.0,
                 num_timesteps: int = 6, timestep_range: tuple = (0.0, 0.6), time_sampling: str = "discrete",
                 ema_ramp_rate: float = 0.001, ema_max_decay: float = 0.3, adv_std: str = "global",
                 adv_clip_max: float = 5.0):
        self.lo, self.hi = check_time_range(timestep_range, num_timesteps, time_sampling)
        self.clip_low, self.clip_high = check_clip_range(clip_range, "the DSM ratio")
        if beta <= 0:
            raise ValueError(f"algorithm.beta={beta} must be > 0")
        if kl_beta < 0:
            raise ValueError(f"algorithm.kl_beta={kl_beta} must be >= 0")
        if not (0 <= ema_max_decay < 1 and ema_ramp_rate >= 0):
            raise ValueError(f"algorithm.ema_max_decay={ema_max_decay} must be in [0, 1) and algorithm.ema_ramp_rate="
                             f"{ema_ramp_rate} >= 0")
        self.beta = beta
        self.clip_dsm, self.clip_kl, self.use_ema_ref, self.shared_noise = clip_dsm, clip_kl, use_ema_ref, shared_noise
        self.kl_beta, self.num_timesteps, self.time_sampling = kl_beta, int(num_timesteps), time_sampling
        self.ema_ramp_rate, self.ema_max_decay = ema_ramp_rate, ema_max_decay
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max

    @property
    def needs_old(self) -> bool:  # the EMA `ema_ref` of Flow-Factory: for the clip masks or as the DGPO reference
        return self.clip_dsm or self.clip_kl or self.use_ema_ref

    @property
    def needs_reference(self) -> bool:
        return not self.use_ema_ref or self.kl_beta > 0

    def num_terms(self, batch: Rollout) -> int:
        return self.num_timesteps

    def old_decay(self, update: int) -> float:
        return ema_ref_decay(update, self.ema_ramp_rate, self.ema_max_decay)

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        x0 = batch.final
        t = term_time(self.time_sampling, self.lo, self.hi, k, self.num_timesteps, policy, batch)
        if self.shared_noise:  # one ε per group for every term (Flow-Factory: timestep-invariant)
            eps = group_noise(x0, batch.group_ids, policy.draws)
        else:
            eps = fresh_noise(x0, policy.draws, batch, k)
        x_t, target = noise_to(x0, eps, policy.stream_sigmas(t))
        v = policy.velocity(batch, x_t, t, guidance=1.0)
        err = dsm_error(v, target)
        adv = batch.advantages.to(err.device)
        stats = {}
        clip = None
        if self.needs_old:
            with torch.no_grad():
                v_old = policy.velocity(batch, x_t, t, policy="old", guidance=1.0)
            old_err = dsm_error(v_old, target)
            if self.clip_dsm or self.clip_kl:
                clip = dgpo_clip_mask(err, old_err, adv, self.clip_low, self.clip_high)
                stats["clip_frac"] = clip.double().mean()
        v_ref = None
        if self.needs_reference:
            with torch.no_grad():
                v_ref = policy.velocity(batch, x_t, t, policy="reference", guidance=1.0)
        ref_err = old_err if self.use_ema_ref else dsm_error(v_ref, target)
        per_sample, w = dgpo_loss(err, ref_err, adv, batch.group_ids, self.beta, clip if self.clip_dsm else None)
        loss = weighted_mean(per_sample, None)
        stats.update({"policy_loss": loss.detach(), "dgpo/dsm": err.detach().mean(), "dgpo/group_weight": w.mean()})
        if self.kl_beta > 0:
            kl = sample_mean({n: (v[n] - v_ref[n]) ** 2 for n in v})
            if self.clip_kl:
                kl = torch.where(clip, kl.detach(), kl)
            loss = loss + self.kl_beta * kl.mean()
            stats["kl"] = kl.detach().mean()
        stats["loss"] = loss.detach()
        return loss, stats
