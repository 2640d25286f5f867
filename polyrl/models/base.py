"""Model adapter interface: everything model-specific the sampler and trainer need, and nothing else.

An adapter owns the pipeline components of one model family. The rollout and the actor only call these
methods, so a new model family is a new file plus a registry entry.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..registry import Registry

# A model's prompt conditioning: named tensors with the batch dimension first (e.g. SD3: prompt_embeds, pooled).
Cond = dict[str, torch.Tensor]


class GeneratorAdapter(Protocol):
    transformer: torch.nn.Module  # the trainable denoiser
    device: torch.device
    default_lora_targets: list[str]

    def encode_prompts(self, prompts: list[str]) -> Cond: ...

    def initial_noise(self, batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """float32 latents at sigma = 1."""
        ...

    def sigmas(self, num_steps: int, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """The sampling grid σ_0 = 1 > … > σ_N = 0 (float32, length num_steps + 1) for `height`×`width` images
        (models with a resolution-dependent shift, e.g. Qwen-Image, need the size; SD3 ignores it)."""
        ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, neg: Cond | None, guidance: float) -> torch.Tensor:
        """CFG velocity `v_u + s·(v_c − v_u)` in float32; `sigma` is (B,). `neg=None` or guidance 1 skips CFG."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1]."""
        ...

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> latents (the inverse of `decode`, mean of the posterior)."""
        ...


MODELS = Registry("model")
register_model = MODELS.register


def build_model(cfg, device: torch.device) -> GeneratorAdapter:
    return MODELS.build(cfg.name, cfg, device)
