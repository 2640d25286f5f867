"""JPEG (in)compressibility rewards (DDPO): the encoded size in kB of the image at a fixed quality."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from .base import RewardOutput, register_reward


def jpeg_kilobytes(images: torch.Tensor, quality: int) -> torch.Tensor:
    """Each image's JPEG size in kB (1000 bytes) at `quality`, images (B, 3, H, W) in [0, 1]."""
    # quantised where the images are (a GPU's uint8 copy to the host is a quarter of float32's)
    pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def kilobytes(image: np.ndarray) -> float:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
        return buf.tell() / 1000.0

    # PIL releases the GIL while it encodes: the images of a chunk encode in parallel
    with ThreadPoolExecutor(max_workers=max(1, min(len(pixels), os.cpu_count() or 1))) as pool:
        sizes = list(pool.map(kilobytes, pixels))
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
