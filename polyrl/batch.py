"""The one batch contract every stage reads and writes.

A `Rollout` holds plain tensors and lists only (no modules, no closures), so it can be pickled to another
process (a Ray actor) as it is. Stages fill it in order: rollout (trajectories, log-probs) -> reward (rewards,
extras) -> advantage (advantages) -> actor update (reads everything).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class Rollout:
    prompts: list[str]
    metadata: list[dict]
    group_ids: torch.Tensor  # (B,) long: samples of one prompt share an id
    cond: dict[str, torch.Tensor]  # model conditioning, batch first
    neg: dict[str, torch.Tensor] | None  # negative-prompt conditioning, (1, ...) broadcast over the batch
    latents: torch.Tensor  # (B, W+1, C, h, w) float32: the states of the trained window
    log_probs: torch.Tensor  # (B, W) float32: rollout log p(x_{k+1} | x_k)
    sigmas: torch.Tensor  # (B, W+1) float32: σ of each stored state
    noise_levels: torch.Tensor  # (B, W) float32: the `a` used at each trained step
    final: torch.Tensor  # (B, C, h, w) float32: the clean latent at σ = 0
    images: torch.Tensor | None = None  # (B, 3, H, W) float in [0, 1]
    rewards: torch.Tensor | None = None  # (B,)
    reward_extras: dict = field(default_factory=dict)
    advantages: torch.Tensor | None = None  # (B,)
    # Rollout correction (ALGORITHMS.md §4). `old_means` is filled by the rollout (the transition means it
    # sampled from) and replaced by the actor's old-policy recompute when rollout_correction.mode != bypass;
    # `old_log_probs` is what the loss uses as log p_old (bypass: the rollout's `log_probs`).
    old_means: torch.Tensor | None = None  # (B, W, C, h, w) float32
    old_log_probs: torch.Tensor | None = None  # (B, W) float32
    step_weights: torch.Tensor | None = None  # (B, W) truncated IS weight × rejection mask (decoupled mode)
    pair_final: torch.Tensor | None = None  # (B, C, h, w): the rejected latent of DPO pair (final[i], pair_final[i])

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: torch.Tensor) -> Rollout:
        """The sub-batch at `idx` (negative conditioning is shared, so it is kept whole)."""
        ids = idx.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "neg" or value is None:
                out[f.name] = value
            elif isinstance(value, torch.Tensor):
                out[f.name] = value[idx.to(value.device)]
            elif isinstance(value, dict):
                out[f.name] = {k: (v[idx.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in ids])
                               for k, v in value.items()}
            else:
                out[f.name] = [value[i] for i in ids]
        return Rollout(**out)

    def to(self, device, skip: tuple[str, ...] = ("images",)) -> Rollout:
        """A copy with every tensor (and every tensor in a dict field) on `device`; fields in `skip` stay where
        they are (the actor update has no use for the decoded images)."""
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            if isinstance(v, dict):
                return {k: move(x) for k, x in v.items()}
            return v

        return Rollout(**{f.name: getattr(self, f.name) if f.name in skip else move(getattr(self, f.name))
                          for f in fields(self)})

    def neg_for(self, batch: int) -> dict[str, torch.Tensor] | None:
        return None if self.neg is None else {k: v.expand(batch, *v.shape[1:]) for k, v in self.neg.items()}

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        out = {}
        for f in fields(Rollout):
            values = [getattr(p, f.name) for p in parts]
            first = values[0]
            if f.name == "neg" or first is None:
                out[f.name] = first
            elif isinstance(first, torch.Tensor):
                out[f.name] = torch.cat(values)
            elif isinstance(first, dict):
                out[f.name] = {k: (torch.cat([v[k] for v in values]) if isinstance(first[k], torch.Tensor)
                                   else sum((list(v[k]) for v in values), [])) for k in first}
            else:
                out[f.name] = sum((list(v) for v in values), [])
        return Rollout(**out)
