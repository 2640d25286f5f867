"""Diffusion-DPO (docs/algorithms.md §3, Wallace et al. 2023): preference pairs, shared noise and timestep.

Online: the best and the worst sample of each group form a pair (groups whose rewards are all equal give none).
Offline: pairs from a dataset (`polyrl/data/pairs.py`), encoded into `final` / `extras["pair_final"]` latents; the
same loss. A pair batch carries the rejected sample's clean latents in `extras["pair_final"]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import Rollout
from ..latents import for_entry, per_sample, sample_mean
from .base import AlgorithmBase, PolicyEvaluator, latent_shapes, register_algorithm, sample_index, weighted_mean


def dpo_loss(err_w, err_l, ref_err_w, ref_err_l, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """z = −½β·[(e_θ^w − e_ref^w) − (e_θ^l − e_ref^l)], L = −log σ(z) per pair; returns (L, z)."""
    z = -0.5 * beta * ((err_w - ref_err_w) - (err_l - ref_err_l))
    return -F.logsigmoid(z), z


def best_worst_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winner index, loser index) per group: its highest and lowest reward (first on ties); equal groups skipped."""
    win, lose = [], []
    for g in torch.unique(group_ids):
        idx = torch.nonzero(group_ids == g).flatten()
        r = rewards[idx]
        if r.max() > r.min():
            win.append(int(idx[int(torch.argmax(r))]))
            lose.append(int(idx[int(torch.argmin(r))]))
    return torch.tensor(win, dtype=torch.long), torch.tensor(lose, dtype=torch.long)


@register_algorithm("diffusion_dpo")
class DiffusionDPO(AlgorithmBase):
    needs_reference = True
    uses_log_probs = False
    trains_on_pairs = True

    def __init__(self, beta: float = 500.0, num_timesteps: int = 2, logit_mean: float = 0.0, logit_std: float = 1.0,
                 adv_std: str = "global", adv_clip_max: float = 5.0):
        self.beta, self.num_timesteps = beta, num_timesteps
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max

    def num_terms(self, batch: Rollout) -> int:
        return self.num_timesteps

    def prepare(self, batch: Rollout) -> Rollout:
        if "pair_final" in batch.extras:  # already pairs (offline data)
            return batch
        win, lose = best_worst_pairs(batch.rewards, batch.group_ids)
        pairs = batch.select(win)
        pairs.extras["pair_final"] = {k: v[lose] for k, v in batch.final.items()}
        return pairs

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, term: int) -> tuple[torch.Tensor, dict]:
        x0_w, x0_l = batch.final, batch.extras["pair_final"]
        b = len(batch)
        device = next(iter(x0_w.values())).device
        # t and ε keyed by (update, pair, term) (§7), drawn on the CPU (the same on any device), then moved
        index = sample_index(batch)
        z = policy.draws.normal("dpo/logit_t", index, {"z": ()}, term)["z"]
        t = torch.sigmoid(self.logit_mean + self.logit_std * z).to(device)
        t_entry = policy.stream_sigmas(t)  # each latent entry's own σ where the model's streams differ
        noise = policy.draws.normal("dpo/eps", index, latent_shapes(x0_w), term)
        x_t, target = {}, {}
        for k in x0_w:  # winner and loser share the noise and the timestep
            eps = noise[k].to(device)
            t_ = per_sample(for_entry(t_entry, k), eps)
            x_t[k] = torch.cat([(1 - t_) * x0_w[k] + t_ * eps, (1 - t_) * x0_l[k] + t_ * eps])
            target[k] = torch.cat([eps - x0_w[k], eps - x0_l[k]])
        both = Rollout.cat([batch, batch])
        tt = torch.cat([t, t])
        v = policy.velocity(both, x_t, tt, guidance=1.0)
        with torch.no_grad():
            v_ref = policy.velocity(both, x_t, tt, policy="reference", guidance=1.0)
        err = sample_mean({k: (v[k] - target[k].to(v[k].device)) ** 2 for k in v})
        ref_err = sample_mean({k: (v_ref[k] - target[k].to(v_ref[k].device)) ** 2 for k in v})
        per_pair, z = dpo_loss(err[:b], err[b:], ref_err[:b], ref_err[b:], self.beta)
        loss = weighted_mean(per_pair, None)
        stats = {"loss": loss.detach(), "policy_loss": loss.detach(), "dpo/accuracy": (z.detach() > 0).double().mean(),
                 "dpo/margin": z.detach().mean()}
        return loss, stats
