"""Decoded media of the three kinds, batch first, as models produce them and rewards read them.

* images: float tensor (B, 3, H, W) in [0, 1];
* video:  float tensor (B, T, 3, H, W) in [0, 1] (T frames);
* audio:  an `Audio` (waveform (B, channels, samples) in [-1, 1] and `sample_rate` in Hz).
* text:   a list of B strings (the decoded responses of a token policy, docs/tokens.md).

A model's `decode` returns them keyed by kind (`{"images": ...}`, `{"video": ..., "audio": ...}`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("images", "video", "audio", "text")


@dataclass
class Audio:
    """A batch of waveforms: `waveform` (B, channels, samples) float in [-1, 1], `sample_rate` in Hz."""

    waveform: torch.Tensor
    sample_rate: int

    def __post_init__(self):
        if self.waveform.ndim != 3:
            raise ValueError(f"Audio.waveform must be (B, channels, samples), got {tuple(self.waveform.shape)}")
        if self.sample_rate <= 0:
            raise ValueError(f"Audio.sample_rate must be > 0, got {self.sample_rate}")

    def __len__(self) -> int:
        return self.waveform.shape[0]

    @staticmethod
    def cat(parts: list[Audio]) -> Audio:
        rates = {p.sample_rate for p in parts}
        if len(rates) > 1:
            raise ValueError(f"cannot concatenate audio of sample rates {sorted(rates)}")
        return Audio(torch.cat([p.waveform for p in parts]), parts[0].sample_rate)


def select_media(value, idx: torch.Tensor):
    if isinstance(value, Audio):
        return Audio(value.waveform[idx.to(value.waveform.device)], value.sample_rate)
    raise TypeError(f"cannot index a batch field of type {type(value).__name__}")


def cpu_media(media: dict) -> dict:
    return {k: (Audio(v.waveform.cpu(), v.sample_rate) if isinstance(v, Audio) else v.cpu()) for k, v in media.items()}


def cat_media(parts: list[dict]) -> dict:
    return {k: (Audio.cat([p[k] for p in parts]) if isinstance(parts[0][k], Audio) else torch.cat([p[k] for p in parts]))
            for k in parts[0]}


def primary(media: dict | None):
    """What a reward of one medium reads: the single kind a model decoded (a dict of several is passed whole)."""
    if media is None:
        return None
    return next(iter(media.values())) if len(media) == 1 else media
