"""`aesthetic`: a LAION-aesthetic-style predictor, an MLP head on the L2-normalised CLIP image embedding.

The LAION "improved aesthetic predictor" (v2) is an MLP 768 -> 1024 -> 128 -> 64 -> 16 -> 1 with Dropout and
no activation between its Linear layers, on CLIP ViT-L/14 image embeddings; its state dict converted to
safetensors (`layers.0`, `layers.2`, `layers.4`, `layers.6`, `layers.7`) loads as it is (`head_path`,
`polyrl.rewards.heads` format). The prompt is not used.
"""

from __future__ import annotations

import torch

from .base import RewardOutput, check_batch, register_reward
from .clip_score import ClipEmbedder
from .heads import load_mlp_head


@register_reward("aesthetic")
class AestheticScore:
    """Score = MLP(normalised CLIP image embedding); `activation` between the head's layers (LAION v2: none)."""

    def __init__(self, path: str, head_path: str, processor_path: str | None = None, prefix: str = "layers.",
                 activation: str = "none", device: str = "auto", dtype: str = "float32"):
        self.clip = ClipEmbedder(path, processor_path, device, dtype)
        self.head = load_mlp_head(head_path, prefix, activation).to(self.clip.device)
        if self.head.out_features != 1:
            raise ValueError(f"aesthetic head {head_path!r} outputs {self.head.out_features} values, need 1")

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("aesthetic", images.shape[0], prompts, metadata)
        emb = self.clip.image_embeds(images)
        if emb.shape[1] != self.head.in_features:
            raise ValueError(f"aesthetic head takes {self.head.in_features}-d embeddings, the CLIP model gives "
                             f"{emb.shape[1]}-d")
        return RewardOutput(self.head(emb).reshape(-1).float().cpu())
