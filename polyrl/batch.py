"""The one batch contract every stage reads and writes.

A `Rollout` holds plain tensors, lists and dicts of them only (no modules, no closures), so it can be pickled to
another process as it is. Stages fill it in order: rollout (trajectories, log-probs, decoded media) -> reward
(rewards, reward_extras) -> advantage (advantages) -> actor update (reads everything).

Per-sample fields are batch first; `select` and `cat` walk them generically (tensors, lists, and dicts of those,
nested), so a new model's latent entries or a new algorithm's `extras` need no code here. `shared` is the one
field that is not per sample: conditioning every sample uses (the negative prompt's, under CFG).

Token policies (models.base.TokenPolicy) fill the same contract: `tokens` holds the prompt and response ids and
masks (`TokenBatch`), and the per-step fields are per response token: `log_probs`, `old_log_probs` and
`step_weights` are (B, R), one entry per response position (0 where `tokens.response_mask` is 0), so rollout
correction treats a token as it treats a diffusion step. Their diffusion fields are empty (`latents` / `final`
{}, `sigmas` / `noise_levels` (B, 0)).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .latents import Latents
from .media import select_media

NOT_PER_SAMPLE = ("shared",)


@dataclass
class TokenBatch:
    """The token ids of a batch of prompts and responses, batch first (token policies, docs/tokens.md).

    Prompts are left-padded and responses right-padded, so `prompt ⧺ response` is one sequence whose real tokens
    are contiguous: response position t is predicted by the logits at sequence position P − 1 + t. Masks are 1 on
    real tokens: `response_mask` covers the generated tokens up to and including the one that ended the response
    (EOS or the last token of a stop string), which is what the losses train on. Padding uses `pad_id`.
    """

    prompt_ids: torch.Tensor  # (B, P) long, left-padded
    prompt_mask: torch.Tensor  # (B, P) long
    response_ids: torch.Tensor  # (B, R) long, right-padded
    response_mask: torch.Tensor  # (B, R) long
    pad_id: int = 0

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], 1)

    def select(self, idx: torch.Tensor) -> TokenBatch:
        i = idx.to(self.prompt_ids.device)
        return TokenBatch(self.prompt_ids[i], self.prompt_mask[i], self.response_ids[i], self.response_mask[i],
                          self.pad_id)

    def to(self, device) -> TokenBatch:
        return TokenBatch(self.prompt_ids.to(device), self.prompt_mask.to(device), self.response_ids.to(device),
                          self.response_mask.to(device), self.pad_id)

    def trimmed(self) -> TokenBatch:
        """The same batch without the columns that are padding in every row (the left of the prompts, the right of
        the responses): what a forward needs, so a batch padded to `rollout.max_new_tokens` costs its real length."""
        p = int(self.prompt_mask.sum(1).max()) if len(self) else 0
        r = int(self.response_mask.sum(1).max()) if len(self) else 0
        return TokenBatch(self.prompt_ids[:, self.prompt_ids.shape[1] - p:], self.prompt_mask[:, self.prompt_mask.shape[1] - p:],
                          self.response_ids[:, :r], self.response_mask[:, :r], self.pad_id)

    @staticmethod
    def cat(parts: list[TokenBatch]) -> TokenBatch:
        """Batches of any prompt / response widths: prompts padded on the left, responses on the right."""
        p = max(t.prompt_ids.shape[1] for t in parts)
        r = max(t.response_ids.shape[1] for t in parts)
        pad = parts[0].pad_id

        def widen(x: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
            extra = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
            return torch.cat([extra, x] if left else [x, extra], 1)

        return TokenBatch(torch.cat([widen(t.prompt_ids, p, pad, True) for t in parts]),
                          torch.cat([widen(t.prompt_mask, p, 0, True) for t in parts]),
                          torch.cat([widen(t.response_ids, r, pad, False) for t in parts]),
                          torch.cat([widen(t.response_mask, r, 0, False) for t in parts]), pad)


def _select(value, idx: torch.Tensor, ids: list[int]):
    if value is None:
        return None
    if isinstance(value, TokenBatch):
        return value.select(idx)
    if isinstance(value, torch.Tensor):
        # to an accelerator without waiting for its queue (the index is staged at once); to the host it must land
        return value[idx.to(value.device, non_blocking=value.device.type != "cpu")]
    if isinstance(value, dict):
        return {k: _select(v, idx, ids) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [value[i] for i in ids]
    return select_media(value, idx)


def _pad_ragged(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors whose per-sample dims differ (a token policy's per-sample media inputs, model=qwen3_omni: patches,
    clips, frames padded to each batch's widest) zero-padded at the end of each dim to the widest; others as given."""
    if len({v.shape[1:] for v in values}) <= 1 or len({v.dim() for v in values}) > 1:
        return values
    width = [max(v.shape[d] for v in values) for d in range(values[0].dim())]
    out = []
    for v in values:
        pad = []
        for d in reversed(range(1, v.dim())):
            pad += [0, width[d] - v.shape[d]]
        out.append(torch.nn.functional.pad(v, pad))
    return out


def _cat(values: list, ragged: bool = False):
    """Concatenate per-sample values; `ragged` (the `cond` field only) zero-pads tensors whose trailing dims differ,
    anywhere else a shape mismatch stays an error."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(_pad_ragged(values) if ragged else values)
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values], ragged) for k in first}
    if isinstance(first, list | tuple):
        return sum((list(v) for v in values), [])
    return type(first).cat(values)


def _to(value, device):
    if isinstance(value, torch.Tensor):
        # to an accelerator the copy is only queued (from pinned memory, e.g. a GPU rollout's results, the host
        # goes on at once; from pageable memory it returns once the data is staged); to the host it must land first
        return value.to(device, non_blocking=torch.device(device).type != "cpu")
    if isinstance(value, TokenBatch):
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
    tokens: TokenBatch | None = None  # token policies: prompt and response ids and masks
    # (B,) long: each sample's place in the step's global training batch, set by the actor's update; it keys the
    # update's random draws (draws.py), so no layout (ranks, micro-batches) changes which numbers a sample gets
    sample_index: torch.Tensor | None = None

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
                          else _cat([getattr(p, f.name) for p in parts], ragged=f.name == "cond")
                          for f in fields(Rollout)})
