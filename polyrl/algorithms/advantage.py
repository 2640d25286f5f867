"""Group advantages for the GRPO family (docs/algorithms.md §2)."""

from __future__ import annotations

import torch

STD_MODES = ("global", "group", "none")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std: str = "global", clip: float = 5.0,
                     eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i − mean_group(r)) / (std + eps), clamped to ±clip.

    `std="global"`: the std of all rewards in the batch (Flow-GRPO default); `"group"`: the std of the sample's
    own group; `"none"`: no division (Dr.GRPO). Stds are population stds (unbiased=False).
    """
    if std not in STD_MODES:
        raise ValueError(f"algorithm.adv_std={std!r}; allowed: {', '.join(STD_MODES)}")
    r = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    count = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if std == "global":
        centred = centred / (r.std(unbiased=False) + eps)
    elif std == "group":
        var = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, centred**2) / count
        centred = centred / (var.sqrt()[inv] + eps)
    return centred.clamp(-clip, clip).to(rewards.dtype)


def zero_std_ratio(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (they carry no learning signal)."""
    groups = torch.unique(group_ids)
    flat = [bool((rewards[group_ids == g] == rewards[group_ids == g][0]).all()) for g in groups]
    return sum(flat) / len(flat)


def advantage_parts(terms: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, std: str = "global",
                    eps: float = 1e-4) -> torch.Tensor:
    """Each reward term's part of `group_advantages` before its clamp (docs/algorithms.md §2), (B, C) float64.

    With r_i = Σ_c t_ic (+ whatever else the algorithm added: a shaping term is not among the parts),
    part_ic = (t_ic − mean_group(t_c)) / (s_i + eps), s_i the std `group_advantages` divides by for these `rewards`
    (the batch's for "global", the sample's group's for "group"; no division for "none"). The mean is linear, so
    Σ_c part_ic = A_i wherever A_i is not clamped and the terms make up the whole reward.
    """
    if std not in STD_MODES:
        raise ValueError(f"algorithm.adv_std={std!r}; allowed: {', '.join(STD_MODES)}")
    r, t = rewards.double(), terms.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    count = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    t_mean = torch.zeros(g, t.shape[1], dtype=t.dtype).index_add_(0, inv, t) / count[:, None]
    parts = t - t_mean[inv]
    if std == "global":
        parts = parts / (r.std(unbiased=False) + eps)
    elif std == "group":
        r_mean = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, r) / count
        var = torch.zeros(g, dtype=r.dtype).index_add_(0, inv, (r - r_mean[inv]) ** 2) / count
        parts = parts / (var.sqrt()[inv] + eps)[:, None]
    return parts


def part_metrics(labels: list[str], parts: torch.Tensor) -> dict[str, float]:
    """Per term c: `adv/part/<c>` = mean_i |part_ic| and `adv/share/<c>` = Σ_i |part_ic| / Σ_{i,c} |part_ic| (its
    share of the advantage's magnitude; the shares sum to 1)."""
    mag = parts.abs()
    total = float(mag.sum())
    out = {}
    for c, label in enumerate(labels):
        out[f"adv/part/{label}"] = float(mag[:, c].mean()) if len(mag) else 0.0
        out[f"adv/share/{label}"] = float(mag[:, c].sum()) / total if total > 0 else 0.0
    return out
