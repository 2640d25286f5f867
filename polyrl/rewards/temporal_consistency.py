"""`temporal_consistency`: how alike a video's consecutive frames are.

Video in (B, T, 3, H, W), values in [0, 1]. With T frames x_0 .. x_{T-1}:

* with `path` (a local image-encoder directory: CLIP / SigLIP vision tower, DINO/DINOv2, anything `AutoModel`
  loads with an `AutoImageProcessor` beside it), every frame is embedded (clip_score.ImageFeatures),
  f_t = normalise(e(x_t)) where e is `get_image_features` when the model has it, else the `pooler_output`, else
  the first token of `last_hidden_state`; score = (1/(T-1)) Σ_t cos(f_t, f_{t+1}), in [-1, 1];
* without `path`, in pixel space: score = 1 - (1/(T-1)) Σ_t mean|x_{t+1} - x_t|, in [0, 1] (1 for a frozen clip).

A one-frame clip scores 1. This is a flicker / identity-drift term meant to be mixed with a content or motion
reward (alone it is maximised by a still video). Extras: `temporal/min_pair`, the least similar consecutive pair.
"""

from __future__ import annotations

import torch

from .base import RewardOutput, check_batch, register_reward
from .clip_score import ImageFeatures


@register_reward("temporal_consistency")
class TemporalConsistency:
    """Mean similarity of consecutive frames (module docstring): cosine of encoder features with `path`,
    1 - mean absolute pixel difference without."""

    inputs = "images"
    media = ("video",)

    def __init__(self, path: str | None = None, device: str = "auto", dtype: str = "float32"):
        self.encoder = ImageFeatures(path, "temporal_consistency encoder path", lambda h: h[:, 0], device,
                                     dtype) if path else None

    def pair_similarity(self, video: torch.Tensor) -> torch.Tensor:
        """(B, T-1) similarity of frames t and t+1."""
        if video.ndim != 5 or video.shape[2] != 3:
            raise ValueError(f"temporal_consistency: expected video (B, T, 3, H, W), got {tuple(video.shape)}")
        b, t = video.shape[:2]
        if t < 2:
            return torch.ones(b, 1)
        if self.encoder is None:
            v = video.float().clamp(0, 1)
            return 1.0 - (v[:, 1:] - v[:, :-1]).abs().flatten(2).mean(-1).cpu()
        f = self.encoder(video.reshape(b * t, *video.shape[2:]))
        f = torch.nn.functional.normalize(f.flatten(1), dim=-1).reshape(b, t, -1)
        return (f[:, 1:] * f[:, :-1]).sum(-1).cpu()

    def __call__(self, video: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        check_batch("temporal_consistency", int(video.shape[0]), prompts, metadata)
        sim = self.pair_similarity(video)
        return RewardOutput(scores=sim.mean(1).float(), extras={"temporal/min_pair": sim.min(1).values.tolist()})
