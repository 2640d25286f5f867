"""Flow-GRPO and its config variants (docs/algorithms.md §3): PPO-clip on the per-step log-ratio, optional KL.

`dance_grpo` (DanceGRPO: the `dance` step, group std, shared initial noise per prompt) and `mix_grpo`
(MixGRPO: mixed ODE/SDE sampling with the `random` / `progressive` window strategies) are the same loss; their
config files (`algorithm=dance_grpo`, `algorithm=mix_grpo`) also set the rollout keys that define them.
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from ..latents import Latents, entries, for_entry, per_sample, sample_mean
from .base import AlgorithmBase, PolicyEvaluator, register_algorithm, weighted_mean


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                  weight: torch.Tensor | None = None):
    """ℓ = max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ = exp(log p_θ − log p_old); returns (mean_b w·ℓ, ρ, clipped mask)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return weighted_mean(torch.maximum(unclipped, clipped), weight), ratio, (clipped > unclipped)


def _nonzero(std: torch.Tensor) -> torch.Tensor:
    return torch.where(std > 0, std, torch.ones_like(std))


def scaled_sq_dist(mean: Latents | torch.Tensor, other: Latents | torch.Tensor, std) -> torch.Tensor:
    """mean_d (μ − μ')² / (2·s²) per sample over every latent entry (one joint mean, §1); s = 0 is divided by 1.
    `std` is (B,), or a dict with each entry's own std (streams on their own σ schedules)."""
    mean, other = entries(mean), entries(other)
    return sample_mean({k: (mean[k] - other[k]) ** 2 / (2 * per_sample(_nonzero(for_entry(std, k)) ** 2, mean[k]))
                        for k in mean})


def gaussian_mean_kl(mean: Latents | torch.Tensor, ref_mean: Latents | torch.Tensor, std) -> torch.Tensor:
    """KL between two Gaussian transitions of equal std: mean_d (μ_θ − μ_ref)² / (2·std²), per sample.

    `std` is the transition std (for `sde`: a·sqrt(σ/(1−σ̃))·sqrt(−dt)), so this is the exact per-element KL; a
    dict gives each latent entry its own. A deterministic step (std = 0, e.g. `cps` into σ' = 0) is not a trained
    transition: its KL is reported as 0.
    """
    mean, ref_mean = entries(mean), entries(ref_mean)
    terms = {}
    for k in mean:
        s = for_entry(std, k)
        d = (mean[k] - ref_mean[k]) ** 2 / (2 * per_sample(_nonzero(s) ** 2, mean[k]))
        terms[k] = torch.where(per_sample(s > 0, d), d, torch.zeros_like(d))
    return sample_mean(terms)


KL_FORMS = ("exact", "flow_grpo", "verl_omni")


def kl_to_reference(mean, ref_mean, std, dt, form: str = "exact", step: str = "sde") -> torch.Tensor:
    """Per-sample KL term of §3. `exact`: the Gaussian KL mean_d Δμ²/(2s²) with s the transition std.

    `flow_grpo`: flow_grpo's form, mean_d Δμ²/(2·std_dev_t²) with std_dev_t the std *its step function returns*
    for the `step` that made the transition (§3 convention (a); read in yifan123/flow_grpo:
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py `sde_step_with_logprob` at commit 54809b5fcf4d, whose `cps`
    branch a later commit added, and the KL line of scripts/train_sd3_fast.py at 74db69191de9, which passes
    `sde_type` through to that function):
    - `sde`: std_dev_t = a·sqrt(σ/(1−σ̃)), the transition std without its √(−dt), so the form is the exact KL ×
      (−dt): the same β weighs late, small steps far less than the exact form does;
    - `cps`: std_dev_t = σ'·sin(aπ/2), already the whole transition std, so the form *is* the exact KL (into
      σ' = 0 flow_grpo divides by 0; here, as for every deterministic step, the KL is 0);
    - `dance` (no such step in flow_grpo): it is the `sde` step with a_i = η·sqrt((1−σ̃)/σ), for which flow_grpo's
      sde function returns std_dev_t = η = s/√(−dt), so the form is again the exact KL × (−dt).
    `verl_omni`: verl-omni's reference and distillation KL (verl-project/verl-omni
    verl_omni/trainer/diffusion/diffusion_algos.py `KLLoss` / `DistillKLLoss` at commit
    a1139bafffb5b9711f0a6b6edff8ecaa60bfff30), the same mean_d Δμ²/(2·std_dev_t²) with the std_dev_t of its
    scheduler's step (verl_omni/pipelines/schedulers/flow_match_sde.py): `sde` a·sqrt(σ/(1−σ̃)), without √(−dt),
    so the exact KL × (−dt), as flow_grpo's; `cps` σ'·sin(aπ/2) and `dance_sde` η·√(−dt), each the whole
    transition std, so the exact KL. It differs from `flow_grpo` on `dance` only.
    With a σ schedule per stream (`std`, `dt` dicts) each entry's term takes its own −dt."""
    if form not in KL_FORMS:
        raise ValueError(f"algorithm.kl_form={form!r}; allowed: {', '.join(KL_FORMS)}")
    if form == "exact" or step == "cps" or (form == "verl_omni" and step == "dance"):
        return gaussian_mean_kl(mean, ref_mean, std)  # std_dev_t is the whole transition std
    if step not in ("sde", "dance"):
        raise ValueError(f"algorithm.kl_form={form}: unknown rollout.step {step!r}; allowed: cps, dance, sde")
    if not isinstance(dt, dict):
        return gaussian_mean_kl(mean, ref_mean, std) * (-dt)
    # Δμ²·(−dt)/(2s²) = Δμ²/(2·(s/√−dt)²), entry by entry
    return gaussian_mean_kl(mean, ref_mean, {k: for_entry(std, k) / torch.sqrt(-dt[k]) for k in dt})


def add_reference_kl(policy: PolicyEvaluator, batch: Rollout, k: int, out, beta: float, loss: torch.Tensor,
                     stats: dict, form: str = "exact") -> torch.Tensor:
    """loss + β·mean_b KL(current ‖ reference) of step k (§3 Flow-GRPO KL); every policy-gradient loss uses it."""
    if beta <= 0:
        return loss
    with torch.no_grad():
        ref = policy.step(batch, k, policy="reference")
    kl = weighted_mean(kl_to_reference(out.mean, ref.mean, out.std, out.dt, form, out.step), out.weight)
    stats["kl"] = kl.detach()
    return loss + beta * kl


def checked_kl_form(form: str, key: str = "kl_form") -> str:
    if form not in KL_FORMS:
        raise ValueError(f"algorithm.{key}={form!r}; allowed: {', '.join(KL_FORMS)}")
    return form


def old_log_prob(batch: Rollout, k: int, like: torch.Tensor) -> torch.Tensor:
    """log p_old of step k: the actor's choice by rollout_correction.mode (bypass: the rollout's)."""
    old = batch.old_log_probs if batch.old_log_probs is not None else batch.log_probs
    return old[:, k].to(like.device)


def old_mean(batch: Rollout, k: int, like: Latents) -> Latents:
    if batch.old_means is None:
        raise RuntimeError("this loss needs the old policy's transition means (Rollout.old_means), which the batch lacks")
    device = next(iter(like.values())).device
    return {name: v[:, k].to(device) for name, v in batch.old_means.items()}


@register_algorithm("flow_grpo")
class FlowGRPO(AlgorithmBase):
    """Loss per trained step k of a mini-batch; the actor averages it over the window and the batch."""

    def __init__(self, clip_range: float = 1e-4, kl_beta: float = 0.0, adv_std: str = "global", adv_clip_max: float = 5.0,
                 kl_form: str = "exact", drop_zero_advantage: bool = False):
        self.clip_range, self.kl_beta = clip_range, kl_beta
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max
        self.kl_form, self.drop_zero_advantage = checked_kl_form(kl_form), drop_zero_advantage

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        return self.policy_loss(policy, batch, k, policy.step(batch, k))

    def policy_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int, out) -> tuple[torch.Tensor, dict]:
        adv = batch.advantages.to(out.log_prob.device)
        loss, ratio, clipped = ppo_clip_loss(out.log_prob, old_log_prob(batch, k, out.log_prob), adv,
                                             self.clip_range, out.weight)
        stats = {"policy_loss": loss.detach(), "clip_frac": clipped.double().mean(), "ratio_mean": ratio.detach().mean(),
                 "ratio_absdev": (ratio.detach() - 1).abs().mean()}
        loss = add_reference_kl(policy, batch, k, out, self.kl_beta, loss, stats, self.kl_form)
        stats["loss"] = loss.detach()
        return loss, stats


@register_algorithm("dance_grpo")
class DanceGRPO(FlowGRPO):
    """DanceGRPO (§3): the Flow-GRPO loss with group-std advantages (the yaml sets the dance step, shared noise)."""

    def __init__(self, clip_range: float = 1e-4, kl_beta: float = 0.0, adv_std: str = "group", adv_clip_max: float = 5.0,
                 kl_form: str = "exact", drop_zero_advantage: bool = False):
        super().__init__(clip_range, kl_beta, adv_std, adv_clip_max, kl_form, drop_zero_advantage)


@register_algorithm("mix_grpo")
class MixGRPO(FlowGRPO):
    """MixGRPO (§3): the Flow-GRPO loss on a mixed ODE/SDE rollout (the yaml sets the window strategy)."""
