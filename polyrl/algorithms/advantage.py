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
