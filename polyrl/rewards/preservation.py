"""`preservation`: how much of the source image an edit left unchanged outside the region it was asked to edit.

For each sample the source image (metadata `source_key`, default `image`: the row's condition image; the first of a
list) is resized to the generated image's size (bicubic) and compared pixel by pixel, over the three RGB channels in
[0, 1], on the pixels *outside* the edit region. The region is a mask image named by metadata `mask_key` (resized
nearest-neighbour; a pixel with value ≥ 0.5 of full scale is inside the region); without `mask_key` every pixel
counts, which scores closeness to the source as a whole (a regulariser to mix with an instruction-following reward).

With O the outside pixels, g the generated and s the source image, and |O| the number of outside values (pixels × 3):
- `l1`:   1 − Σ_O |g − s| / |O|                     ∈ [0, 1]
- `mse`:  1 − Σ_O (g − s)² / |O|                    ∈ [0, 1]
- `psnr`: 10·log10(1 / (Σ_O (g − s)² / |O|)) in dB, capped at `max_psnr` (an exact copy scores the cap)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import RewardOutput, check_batch, media_kind, register_reward

METRICS = ("l1", "mse", "psnr")


def preservation_score(generated: np.ndarray, source: np.ndarray, outside: np.ndarray, metric: str,
                       max_psnr: float) -> float:
    """One sample's score (module docstring): `generated`, `source` (H, W, 3) in [0, 1], `outside` (H, W) bool."""
    diff = (generated - source)[outside]
    if metric == "l1":
        return float(1.0 - np.abs(diff).mean())
    mse = float((diff**2).mean())
    if metric == "mse":
        return 1.0 - mse
    return max_psnr if mse == 0.0 else min(max_psnr, 10.0 * math.log10(1.0 / mse))


def _first_path(value, key: str, index: int) -> str:
    path = value[0] if isinstance(value, list | tuple) and value else value
    if not isinstance(path, str):
        raise ValueError(f"reward preservation: sample {index} has no metadata {key!r} path (got {value!r})")
    return path


def _load(path: str, size: tuple[int, int], mode: str, resample) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert(mode).resize(size, resample), dtype=np.float64) / 255.0
    except OSError as e:
        raise ValueError(f"reward preservation: {path}: {e}") from None


@register_reward("preservation")
class Preservation:
    """Pixel preservation of the source outside the edit region (module docstring)."""

    def __init__(self, metric: str = "l1", source_key: str = "image", mask_key: str | None = None,
                 max_psnr: float = 50.0):
        if metric not in METRICS:
            raise ValueError(f"preservation: metric={metric!r} is not valid; allowed: {', '.join(METRICS)}")
        if not max_psnr > 0:
            raise ValueError(f"preservation: max_psnr={max_psnr} must be > 0")
        self.metric, self.source_key, self.mask_key, self.max_psnr = metric, source_key, mask_key, float(max_psnr)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        from PIL import Image

        if media_kind(images) != "images":
            raise ValueError(f"reward preservation scores images (B, 3, H, W), got {tuple(images.shape)}")
        metadata = check_batch("preservation", images.shape[0], prompts, metadata)
        generated = images.detach().to("cpu", torch.float64).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        size = (generated.shape[2], generated.shape[1])  # PIL: (width, height)
        scores, fractions = [], []
        for i, (g, meta) in enumerate(zip(generated, metadata, strict=True)):
            source = _load(_first_path(meta.get(self.source_key), self.source_key, i), size, "RGB", Image.BICUBIC)
            outside = np.ones(g.shape[:2], dtype=bool)
            if self.mask_key is not None:
                mask = _load(_first_path(meta.get(self.mask_key), self.mask_key, i), size, "L", Image.NEAREST)
                outside = mask < 0.5
            if not outside.any():
                raise ValueError(f"reward preservation: sample {i}'s edit region covers the whole image "
                                 "(nothing left to preserve)")
            scores.append(preservation_score(g, source, outside, self.metric, self.max_psnr))
            fractions.append(float(outside.mean()))
        return RewardOutput(torch.tensor(scores, dtype=torch.float32), {"preservation/outside_fraction": fractions})
