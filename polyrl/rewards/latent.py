"""`latent_predictor`: a reward read from the generator's clean latents, so no VAE decode is needed.

Features per sample: the per-channel mean and standard deviation of the latent over all its spatial (and
time) positions, [mean_1..mean_C, std_1..std_C] (2C values, independent of the resolution), fed to an MLP
head loaded from a safetensors file (`polyrl.rewards.heads` format, ReLU between layers by default). The head
is whatever latent-space reward model you trained on such features; the test suite builds a tiny one.
"""

from __future__ import annotations

import torch

from .base import RewardOutput, check_batch, register_reward
from .heads import load_mlp_head


def latent_channel_stats(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, ...) -> (B, 2C): per-channel mean then per-channel population std over the other axes."""
    if latents.ndim < 3:
        raise ValueError(f"expected latents (B, C, h, w) or (B, C, T, h, w), got {tuple(latents.shape)}")
    flat = latents.flatten(2)
    return torch.cat([flat.mean(-1), flat.std(-1, unbiased=False)], dim=1)


@register_reward("latent_predictor")
class LatentPredictor:
    """Score = MLP(latent_channel_stats(latents)); `path`: the head's safetensors file."""

    inputs = "latents"

    def __init__(self, path: str, prefix: str = "layers.", activation: str = "relu"):
        self.head = load_mlp_head(path, prefix, activation)
        if self.head.out_features != 1:
            raise ValueError(f"latent_predictor head {path!r} outputs {self.head.out_features} values, need 1")

    @torch.no_grad()
    def __call__(self, images, prompts, metadata, latents: torch.Tensor | None = None) -> RewardOutput:
        if latents is None:
            raise ValueError("latent_predictor reads latents (it declares inputs='latents'); none were given")
        check_batch("latent_predictor", latents.shape[0], prompts, metadata)
        feats = latent_channel_stats(latents.detach().to("cpu", torch.float32))
        if feats.shape[1] != self.head.in_features:
            raise ValueError(f"latent_predictor head expects {self.head.in_features} features (2 x channels), the "
                             f"latents have {latents.shape[1]} channels")
        return RewardOutput(self.head(feats).reshape(-1).float())
