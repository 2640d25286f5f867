"""Model interface: everything model-specific the sampler and the actor need, and nothing else.

A `DiffusionPolicy` owns the pipeline components of one model family: its trainable networks (`modules()`), its
text/condition encoders, its latent layout for a `MediaShape`, its sigma grid, its guidance and its decoder.
The rollout and the actor only call these methods, so a new family is a new file plus a registry entry.

Guidance belongs to the model: `encode_guidance` returns the conditioning its guidance form needs and that every
sample shares (the negative prompt's embeddings for CFG and true CFG; nothing for guidance-embedding models), and
`velocity` applies the form (CFG, true CFG with norm rescale, ...). The rollout only carries a scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..latents import Latents, MediaShape
from ..registry import Registry

# A model's prompt conditioning: named tensors with the batch dimension first (e.g. SD3: prompt_embeds, pooled).
Cond = dict[str, torch.Tensor]
# A prompt is its text, or a dict {"text": str, "images": [...], "audio": ...} for condition-media models
# (image-to-video, edit); a model without condition inputs refuses a prompt that carries media.
Prompt = str | dict
# Decoded media by kind: {"images": (B, 3, H, W)} or {"video": (B, T, 3, H, W)} in [0, 1], {"audio": Audio}.
Media = dict[str, Any]


def prompt_text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt["text"]


def text_only(prompts: list[Prompt], family: str) -> list[str]:
    """The prompts' texts; a prompt with condition media is an error for a text-only model."""
    for p in prompts:
        if isinstance(p, dict) and set(p) - {"text"}:
            raise ValueError(f"{family} generates from text only, but a prompt carries {sorted(set(p) - {'text'})}")
    return [prompt_text(p) for p in prompts]


@dataclass(frozen=True)
class Guidance:
    """A rollout's guidance request; the model decides what it means (CFG, true CFG, embedded guidance)."""

    scale: float = 1.0
    negative_prompt: str = ""


class DiffusionPolicy(Protocol):
    device: torch.device
    default_lora_targets: list[str]
    flops: float  # model FLOPs executed so far (docs/algorithms.md §6); the trainer reads the difference per step

    def modules(self) -> dict[str, torch.nn.Module]:
        """The trainable networks by name (the live mapping: the actor may swap an entry for another policy)."""
        ...

    def encode_prompts(self, prompts: list[Prompt]) -> Cond:
        """Per-sample conditioning, batch first (cached per prompt: the encoders are frozen)."""
        ...

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """Conditioning every sample shares under this guidance, each tensor (1, ...); {} when none is needed."""
        ...

    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        """Per-sample latent shape of each entry (no batch dimension); a shape the model cannot make is an error."""
        ...

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The sampling grid σ_0 = 1 > … > σ_N = 0 (float32, length num_steps + 1) for this media shape."""
        ...

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The guided velocity in float32; `sigma` is (B,); guidance 1 (or no `shared`) is the conditional one."""
        ...

    def decode(self, latents: Latents) -> Media:
        """Clean latents -> decoded media, float in [0, 1] (waveforms in [-1, 1])."""
        ...

    def encode_media(self, media: Media) -> Latents:
        """Decoded media -> clean latents (the inverse of `decode`: the posterior mean)."""
        ...


MODELS = Registry("model")
register_model = MODELS.register


def build_model(cfg, device: torch.device) -> DiffusionPolicy:
    return MODELS.build(cfg.name, cfg, device)
