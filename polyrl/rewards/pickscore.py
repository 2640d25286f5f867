"""`pickscore`: the PickScore convention, logit_scale.exp() * cos(image, prompt) with a CLIP-H-layout model.

The released PickScore_v1 checkpoint is a `CLIPModel` (ViT-H/14) whose processor is the one of
laion/CLIP-ViT-H-14-laion2B-s32B-b79K: point `path` at the model directory and `processor_path` at the
processor's. Its logit_scale.exp() is about 100, so raw scores are around 20-23; Flow-GRPO divides them by 26
to bring them near [0, 1] (`scale`).
"""

from __future__ import annotations

from .base import RewardOutput, check_batch, register_reward
from .clip_score import ClipEmbedder


@register_reward("pickscore")
class PickScore:
    """Score = scale * exp(logit_scale) * cos(image embedding, prompt embedding)."""

    def __init__(self, path: str, processor_path: str | None = None, scale: float = 1.0, device: str = "auto",
                 dtype: str = "float32"):
        self.clip = ClipEmbedder(path, processor_path, device, dtype)
        self.scale = float(scale)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("pickscore", images.shape[0], prompts, metadata)
        cos = (self.clip.image_embeds(images) * self.clip.text_embeds(prompts)).sum(-1)
        logit_scale = self.clip.model.logit_scale.detach().float().exp()
        return RewardOutput((self.scale * logit_scale * cos).cpu(), {"pickscore/cos": cos.cpu().tolist()})
