"""jpeg_compressibility / jpeg_incompressibility (DDPO): each image's JPEG size in kB at the configured quality,
against a serial PIL encode of pixels quantised independently in float64."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from polyrl.rewards.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_kilobytes


def reference_kilobytes(images: np.ndarray, quality: int) -> list[float]:
    out = []
    for image in images:  # (3, H, W) float64 in [0, 1]
        pixels = np.rint(np.clip(image, 0, 1) * 255).astype(np.uint8).transpose(1, 2, 0)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
        out.append(len(buf.getvalue()) / 1000.0)
    return out


def test_sizes_equal_a_serial_encode_and_noise_costs_more_bytes():
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 255, size=(6, 3, 48, 40))
    # keep clear of .5 so float32 and float64 quantise alike
    offsets = rng.choice([0.2, 0.3, 0.7, 0.8], size=levels.shape)
    images = (levels + offsets) / 255.0
    images[0] = 0.5 + 0.0 * images[0]  # flat grey: compresses best
    images[1] = np.linspace(0.1, 0.9, 40)[None, None, :] + 0.0 * images[1]  # a smooth ramp
    got = jpeg_kilobytes(torch.tensor(images, dtype=torch.float32), 95)
    assert got.tolist() == torch.tensor(reference_kilobytes(images, 95), dtype=torch.float32).tolist()
    assert got[0] < got[1] < got[2:].min()  # flat < ramp < noise
    assert jpeg_kilobytes(torch.tensor(images, dtype=torch.float32), 50)[2:].max() < got[2:].min()


def test_rewards_are_minus_and_plus_the_size_and_accept_bfloat16():
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    kb = jpeg_kilobytes(images, 95)
    smaller = JpegCompressibility()(images, ["p"] * 3, [{}] * 3)
    larger = JpegIncompressibility()(images, ["p"] * 3, [{}] * 3)
    assert torch.equal(smaller.scores, -kb) and torch.equal(larger.scores, kb)
    assert smaller.extras["jpeg/kilobytes"] == kb.tolist()
    assert jpeg_kilobytes(images.to(torch.bfloat16), 95).shape == (3,)
