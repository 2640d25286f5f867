"""JPEG (in)compressibility rewards (DDPO): the encoded size in kB of the image at a fixed quality."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from .base import RewardOutput, register_reward


def jpeg_kilobytes(images: torch.Tensor, quality: int) -> torch.Tensor:
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    sizes = []
    for a in arr:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
class JpegCompressibility:
    """Score = −kB: smaller files score higher."""

    def __init__(self, quality: int = 95):
        self.quality = quality

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        kb = jpeg_kilobytes(images, self.quality)
        return RewardOutput(-kb, {"jpeg/kilobytes": kb.tolist()})


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(JpegCompressibility):
    """Score = +kB: larger (more detailed) files score higher."""

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        kb = jpeg_kilobytes(images, self.quality)
        return RewardOutput(kb, {"jpeg/kilobytes": kb.tolist()})
