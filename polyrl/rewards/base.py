"""Reward stage interface: media + prompts + metadata -> scores + extras.

A reward is any callable object registered under a name; `build_reward(cfg)` makes one from the `reward`
config group (`reward.name` picks the class, the other keys are its constructor arguments).

Call convention (docs/rewards.md, "Scorers"):

    reward(media, prompts, metadata) -> RewardOutput                       # a reward of decoded media
    reward(media, prompts, metadata, latents=latents) -> RewardOutput      # one that also/only reads latents

`media` is what the generator's VAE decode gives, batch first:

* images: float tensor (B, 3, H, W) in [0, 1];
* video:  float tensor (B, T, 3, H, W) in [0, 1] (T frames);
* audio:  an `Audio` (waveform (B, channels, samples) in [-1, 1] and `sample_rate` in Hz).

A reward declares what it reads with the class attribute `inputs` ("images" when absent; "latents"; or a
tuple of both). "images" stands for decoded media of any of the three kinds. A reward whose `inputs` does not
contain "images" is called with `media=None`, and the trainer then skips the VAE decode for it.
`latents` are the generator's clean latents (B, C, h, w) (or (B, C, T, h, w) for video), float32, on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..registry import Registry

INPUT_KINDS = ("images", "latents")


@dataclass
class RewardOutput:
    """`scores`: (B,) float32, one per sample. `extras`: per-sample numeric diagnostics, name -> length-B
    list/tensor (the trainer logs each one's mean over the finite values)."""

    scores: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


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


class Reward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        """`images`: (B, 3, H, W) float in [0, 1] on CPU (or video / `Audio`, see the module docstring)."""
        ...


def reward_inputs(reward) -> frozenset[str]:
    """What a reward reads: a subset of {"images", "latents"} from its `inputs` attribute (default images)."""
    declared = getattr(reward, "inputs", "images")
    kinds = frozenset([declared] if isinstance(declared, str) else declared)
    bad = sorted(kinds - set(INPUT_KINDS))
    if bad or not kinds:
        raise ValueError(f"reward {type(reward).__name__}: inputs={declared!r}; allowed: {', '.join(INPUT_KINDS)}")
    return kinds


def media_kind(media) -> str:
    """"images", "video" or "audio" for a batch of decoded media; a clear error for anything else."""
    if isinstance(media, Audio):
        return "audio"
    if isinstance(media, torch.Tensor) and media.ndim == 4 and media.shape[1] == 3:
        return "images"
    if isinstance(media, torch.Tensor) and media.ndim == 5 and media.shape[2] == 3:
        return "video"
    shape = tuple(media.shape) if isinstance(media, torch.Tensor) else type(media).__name__
    raise ValueError(f"expected images (B, 3, H, W), video (B, T, 3, H, W) or Audio, got {shape}")


def media_len(media) -> int:
    return len(media) if isinstance(media, Audio) else int(media.shape[0])


def call_reward(reward, media, prompts: list[str], metadata: list[dict], latents: torch.Tensor | None = None):
    """Call `reward` with what it declares it reads (the one place the convention above is applied)."""
    kinds = reward_inputs(reward)
    if "images" in kinds and media is None:
        raise ValueError(f"reward {type(reward).__name__} reads images but none were decoded")
    if "latents" not in kinds:
        return reward(media, prompts, metadata)
    if latents is None:
        raise ValueError(f"reward {type(reward).__name__} reads latents but none were given")
    return reward(media if "images" in kinds else None, prompts, metadata, latents=latents)


def image_batch_as_uint8(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [0, 1] -> B numpy arrays (H, W, 3) uint8 (the input most image processors expect)."""
    if media_kind(images) != "images":
        raise ValueError(f"expected images (B, 3, H, W), got {tuple(images.shape)}")
    arr = images.detach().to("cpu", torch.float32).clamp(0, 1).mul(255).round().to(torch.uint8)
    return list(arr.permute(0, 2, 3, 1).numpy())


def check_batch(name: str, n: int, prompts: list[str], metadata: list[dict] | None) -> list[dict]:
    """Metadata as a list of length n (empty dicts when None); prompts and metadata must match the batch."""
    if len(prompts) != n:
        raise ValueError(f"reward {name}: got {n} samples but {len(prompts)} prompts")
    metadata = list(metadata) if metadata is not None else [{} for _ in range(n)]
    if len(metadata) != n:
        raise ValueError(f"reward {name}: got {n} samples but {len(metadata)} metadata entries")
    return metadata


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


REWARDS = Registry("reward")
register_reward = REWARDS.register


def build_reward(cfg: dict) -> Reward:
    cfg = dict(cfg)
    cfg.pop("async", None)  # a reward-stage option (rewards/stage.py), not a constructor argument
    return REWARDS.build(cfg.pop("name"), **cfg)
