"""`clip_score`: cosine similarity between the CLIP embeddings of the image and of the prompt.

`ClipEmbedder` is shared by `pickscore` and `aesthetic`: a transformers CLIP-layout model (`CLIPModel`, or any
model with `get_image_features` / `get_text_features`) loaded with `from_pretrained` from a local directory,
its tokenizer and image processor from the same directory or from `processor_path` (PickScore ships its
model apart from the CLIP-H processor it was trained with). Images go through the checkpoint's own image
processor (resize, centre crop, normalise) as uint8 RGB, so preprocessing is the checkpoint's, not ours.

`ImageFeatures` is the image side alone, for any local image model (`group_diversity`, `temporal_consistency`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .base import (
    RewardOutput,
    check_batch,
    image_batch_as_uint8,
    media_kind,
    register_reward,
    resolve_device,
    resolve_dtype,
)


def _pooled(out) -> torch.Tensor:
    """transformers >= 5 returns a model output whose `pooler_output` is the projected embedding; 4.x a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def local_dir(path: str | None, what: str) -> str:
    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"{what}: {path!r} is not a local model directory (weights are never downloaded)")
    return str(path)


class ClipEmbedder:
    def __init__(self, path: str, processor_path: str | None = None, device: str = "auto", dtype: str = "float32"):
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        path = local_dir(path, "CLIP model path")
        processor_path = local_dir(processor_path or path, "CLIP processor path")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model = AutoModel.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
        self.image_processor = AutoImageProcessor.from_pretrained(processor_path)
        text_cfg = getattr(self.model.config, "text_config", self.model.config)
        self.max_length = getattr(text_cfg, "max_position_embeddings", 77)

    def pixel_values(self, images: torch.Tensor) -> torch.Tensor:
        if media_kind(images) != "images":
            raise ValueError(f"CLIP scorers score images (B, 3, H, W), got {tuple(images.shape)}")
        return self.image_processor(images=image_batch_as_uint8(images), return_tensors="pt")["pixel_values"]

    def text_inputs(self, prompts: list[str]) -> dict:
        return self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt")

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """(B, D) float32, L2-normalised."""
        pv = self.pixel_values(images).to(self.device, self.dtype)
        return torch.nn.functional.normalize(_pooled(self.model.get_image_features(pixel_values=pv)).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """(B, D) float32, L2-normalised."""
        t = {k: v.to(self.device) for k, v in self.text_inputs(prompts).items()}
        feats = self.model.get_text_features(input_ids=t["input_ids"], attention_mask=t.get("attention_mask"))
        return torch.nn.functional.normalize(_pooled(feats).float(), dim=-1)


class ImageFeatures:
    """A local image model's features: `__call__(images (N, 3, H, W) in [0, 1]) -> (N, D)` float32 on its device.

    Any checkpoint `AutoModel` and `AutoImageProcessor` load from `path` (`what` names its config key in errors).
    The features are `get_image_features` where the model has it (CLIP, SigLIP), else the forward's `pooler_output`
    (a vision tower, DINOv2), else `pool(last_hidden_state)` with last_hidden_state (N, tokens, D)."""

    def __init__(self, path: str, what: str, pool: Callable[[torch.Tensor], torch.Tensor], device: str = "auto",
                 dtype: str = "float32"):
        from transformers import AutoImageProcessor, AutoModel

        path = local_dir(path, what)
        self.device, self.dtype, self.pool = resolve_device(device), resolve_dtype(dtype), pool
        self.model = AutoModel.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        pv = self.processor(images=image_batch_as_uint8(images), return_tensors="pt")["pixel_values"]
        pv = pv.to(self.device, self.dtype)
        if hasattr(self.model, "get_image_features"):
            return _pooled(self.model.get_image_features(pixel_values=pv)).float()
        out = self.model(pixel_values=pv)
        pooled = getattr(out, "pooler_output", None)
        return (pooled if pooled is not None else self.pool(out.last_hidden_state)).float()


@register_reward("clip_score")
class ClipScore:
    """Score = cos(image embedding, prompt embedding) in [-1, 1] (no 2.5 * max(cos, 0) CLIPScore rescaling)."""

    def __init__(self, path: str, processor_path: str | None = None, device: str = "auto", dtype: str = "float32"):
        self.clip = ClipEmbedder(path, processor_path, device, dtype)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("clip_score", images.shape[0], prompts, metadata)
        cos = (self.clip.image_embeds(images) * self.clip.text_embeds(prompts)).sum(-1)
        return RewardOutput(cos.cpu())
