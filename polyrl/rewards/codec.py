"""Images on the wire: base64 PNG (lossless) or JPEG, both ways, with size checks before decoding.

PNG keeps the uint8 image exactly, so a served scorer sees what a local one would after the usual
`round(x * 255)` quantisation.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import torch
from PIL import Image

FORMATS = ("png", "jpeg")


class ImageDecodeError(ValueError):
    """An image that is not valid base64 PNG/JPEG (the server answers 422)."""


class ImageTooLarge(ValueError):
    """An image over the pixel limit (the server answers 413); raised before the pixels are decoded."""


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, rounded as every built-in scorer rounds."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape (B, 3, H, W), got {tuple(images.shape)}")
    return (images.detach().float().clamp(0, 1).mul(255).round()).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def encode_image_bytes(pixels: np.ndarray, fmt: str = "png", quality: int = 95) -> bytes:
    """One (H, W, 3) uint8 image as PNG or JPEG file bytes."""
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # lossless; level 1 is the fast one
    elif fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    else:
        raise ValueError(f"image format {fmt!r} is not supported; allowed: {', '.join(FORMATS)}")
    return buf.getvalue()


def encode_images(images: torch.Tensor, fmt: str = "png", quality: int = 95) -> list[str]:
    """(B, 3, H, W) float in [0, 1] -> B base64 strings of PNG/JPEG files."""
    return [base64.b64encode(encode_image_bytes(a, fmt, quality)).decode("ascii") for a in to_uint8(images)]


def decode_image(data: str, max_pixels: int) -> np.ndarray:
    """A base64 PNG/JPEG (a `data:image/...;base64,` prefix is allowed) -> (H, W, 3) uint8.

    The header is read first, so an image over `max_pixels` is refused without decoding its pixels.
    """
    if not isinstance(data, str):
        raise ImageDecodeError(f"expected a base64 string, got {type(data).__name__}")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageDecodeError(f"not valid base64 ({e})") from None
    try:
        img = Image.open(io.BytesIO(raw))
    except Exception as e:  # PIL raises several types for non-images
        raise ImageDecodeError(f"not a PNG or JPEG image ({type(e).__name__})") from None
    if img.format not in ("PNG", "JPEG"):
        raise ImageDecodeError(f"image format {img.format} is not accepted; send PNG or JPEG")
    w, h = img.size
    if w * h > max_pixels:
        raise ImageTooLarge(f"image of {w}x{h} = {w * h} pixels is over the limit of {max_pixels} pixels")
    try:
        return np.asarray(img.convert("RGB"))
    except Exception as e:  # truncated or corrupt pixel data
        raise ImageDecodeError(f"could not decode the image ({type(e).__name__}: {e})") from None


def stack_images(pixels: list[np.ndarray]) -> torch.Tensor:
    """Equal-sized (H, W, 3) uint8 images -> (B, 3, H, W) float32 in [0, 1]."""
    shapes = {p.shape for p in pixels}
    if len(shapes) > 1:
        raise ImageDecodeError(f"all images of a request must have one size, got {sorted(s[:2] for s in shapes)}")
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float().div(255.0)
