"""The one batch contract every stage reads and writes.

A `Rollout` holds plain tensors, lists and dicts of them only (no modules, no closures), so it can be pickled to
another process as it is. Stages fill it in order: rollout (trajectories, log-probs, decoded media) -> reward
(rewards, reward_extras) -> advantage (advantages) -> actor update (reads everything).

Per-sample fields are batch first; `select` and `cat` walk them generically (tensors, lists, and dicts of those,
nested), so a new model's latent entries or a new algorithm's `extras` need no code here. `shared` is the one
field that is not per sample: conditioning every sample uses (the negative prompt's, under CFG).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .latents import Latents
from .media import select_media

NOT_PER_SAMPLE = ("shared",)


def _select(value, idx: torch.Tensor, ids: list[int]):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[idx.to(value.device)]
    if isinstance(value, dict):
        return {k: _select(v, idx, ids) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [value[i] for i in ids]
    return select_media(value, idx)


def _cat(values: list):
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values]) for k in first}
    if isinstance(first, list | tuple):
        return sum((list(v) for v in values), [])
    return type(first).cat(values)


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


@dataclass
class Rollout:
    prompts: list  # list[models.base.Prompt]: text, or {"text", "images", ...} for condition-media models
    metadata: list[dict]
    group_ids: torch.Tensor  # (B,) long: samples of one prompt share an id
    cond: dict[str, torch.Tensor]  # per-sample model conditioning, batch first
    shared: dict[str, torch.Tensor]  # conditioning all samples share (guidance's negative prompt), each (1, ...)
    latents: Latents  # each (B, W+1, ...) float32: the states of the trained window
    log_probs: torch.Tensor  # (B, W) float32: rollout log p(x_{k+1} | x_k), joint over the latent entries
    sigmas: torch.Tensor  # (B, W+1) float32: σ of each stored state
    noise_levels: torch.Tensor  # (B, W) float32: the `a` used at each trained step
    final: Latents  # each (B, ...) float32: the clean latents at σ = 0
    media: dict[str, Any] | None = None  # decoded media by kind (models.base.Media)
    rewards: torch.Tensor | None = None  # (B,)
    reward_extras: dict = field(default_factory=dict)
    advantages: torch.Tensor | None = None  # (B,)
    # Rollout correction (docs/algorithms.md §4). `old_means` is filled by the rollout (the transition means it
    # sampled from) and replaced by the actor's old-policy recompute when rollout_correction.mode != bypass;
    # `old_log_probs` is what the loss uses as log p_old (bypass: the rollout's `log_probs`).
    old_means: Latents | None = None  # each (B, W, ...) float32
    old_log_probs: torch.Tensor | None = None  # (B, W) float32
    step_weights: torch.Tensor | None = None  # (B, W) truncated IS weight × rejection mask (decoupled mode)
    extras: dict = field(default_factory=dict)  # an algorithm's per-sample payload (e.g. DPO's rejected latents)

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: torch.Tensor) -> Rollout:
        """The sub-batch at `idx` (`shared` is kept whole)."""
        ids = idx.tolist()
        return Rollout(**{f.name: getattr(self, f.name) if f.name in NOT_PER_SAMPLE
                          else _select(getattr(self, f.name), idx, ids) for f in fields(self)})

    def to(self, device, skip: tuple[str, ...] = ("media",)) -> Rollout:
        """A copy with every tensor (nested in dicts too) on `device`; fields in `skip` stay where they are (the
        actor update has no use for decoded media)."""
        return Rollout(**{f.name: getattr(self, f.name) if f.name in skip else _to(getattr(self, f.name), device)
                          for f in fields(self)})

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        return Rollout(**{f.name: getattr(parts[0], f.name) if f.name in NOT_PER_SAMPLE
                          else _cat([getattr(p, f.name) for p in parts]) for f in fields(Rollout)})
