"""Latents of any modality: named tensors, batch first, and the few pure operations every stage needs on them.

A model's latent state is a `Latents` dict: `{"x": (B, C, h, w)}` for an image model, `{"x": (B, C, F, h, w)}` for
a video model, `{"video": (B, N, C), "audio": (B, L, C)}` for a joint audio-video model. Step math runs per entry
with the same σ and transition std for every entry, and one sample's log-density is the mean over *all* its
elements (one joint log-prob, docs/algorithms.md §1), so an image model with one entry computes exactly what a single
tensor did.

`MediaShape` says what a rollout generates (height, width, and for video the frames, for audio the seconds); the
model turns it into latent shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Latents = dict[str, torch.Tensor]


@dataclass(frozen=True)
class MediaShape:
    """What one sample is: an image (`frames` 0), a video of `frames` frames at `fps`, or `seconds` of audio."""

    height: int = 0
    width: int = 0
    frames: int = 0  # 0: an image
    fps: float = 16.0
    seconds: float = 0.0  # audio length (audio and audio-video models)

    @property
    def is_video(self) -> bool:
        return self.frames > 0


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """A network output for the step math: bf16 / fp16 up to float32, float32 and float64 as they are (a float64 run
    stays float64 end to end: the equality tests' precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def map_latents(fn: Callable[..., torch.Tensor], *entries: Latents) -> Latents:
    """{k: fn(a[k], b[k], ...)} over the keys of the first argument (all arguments share the keys)."""
    return {k: fn(*(e[k] for e in entries)) for k in entries[0]}


def batch_size(latents: Latents) -> int:
    return next(iter(latents.values())).shape[0]


def per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B,) tensor viewed to broadcast over `like`'s trailing dimensions."""
    return t.view(-1, *([1] * (like.dim() - 1)))


def sample_mean(values: Latents | torch.Tensor) -> torch.Tensor:
    """Per-sample mean over every element of every entry: Σ_e Σ_d x / Σ_e D_e, shape (B,).

    For one entry this is `x.flatten(1).mean(1)`; for several it weights each entry by its element count, which
    is what makes one joint log-density (and one joint KL) over video + audio latents.
    """
    if isinstance(values, torch.Tensor):
        return values.flatten(1).mean(1)
    if len(values) == 1:
        return next(iter(values.values())).flatten(1).mean(1)
    total = sum(v.flatten(1).sum(1) for v in values.values())
    count = sum(v[0].numel() for v in values.values())
    return total / count


def randn_latents(shapes: dict[str, tuple[int, ...]], generator: torch.Generator) -> Latents:
    """Standard normal float32 latents of the given per-entry shapes, drawn on the CPU in key order."""
    return {k: torch.randn(s, generator=generator, dtype=torch.float32) for k, s in shapes.items()}


def cat_latents(parts: list[Latents], dim: int = 0) -> Latents:
    return {k: torch.cat([p[k] for p in parts], dim) for k in parts[0]}


def stack_latents(parts: list[Latents], dim: int = 1) -> Latents:
    return {k: torch.stack([p[k] for p in parts], dim) for k in parts[0]}


def select_step(latents: Latents, k) -> Latents:
    """Entry [:, k] of each trajectory tensor (B, S, ...) -> (B, ...)."""
    return {name: v[:, k] for name, v in latents.items()}


def to_device(latents: Latents, device, dtype: torch.dtype | None = None, non_blocking: bool = False) -> Latents:
    return {k: v.to(device, dtype, non_blocking=non_blocking) for k, v in latents.items()}


def for_entry(value, name: str):
    """`value[name]` when `value` holds one value per latent entry (a dict), else `value` itself: σ, std and dt are
    shared by every entry except in a model that runs a σ schedule per stream (`DiffusionPolicy.stream_sigmas`)."""
    return value[name] if isinstance(value, dict) else value


def entries(x: Latents | torch.Tensor) -> Latents:
    """A bare tensor as the one-entry Latents {"x": tensor} (pure math accepts either)."""
    return x if isinstance(x, dict) else {"x": x}
