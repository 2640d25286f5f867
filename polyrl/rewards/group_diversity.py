"""`group_diversity`: a group reward (rewards/base.py, docs/rewards.md "Group rewards") that scores each sample by how
far it lies from the other members of its prompt's group in the feature space of a local image model.

For a group of n >= 2 samples with L2-normalised features f_1 .. f_n (docs/rewards.md, "group_diversity"):

    score_i = 1/(n-1) * sum_{j != i} (1 - cos(f_i, f_j))        in [0, 2]

so a sample that repeats its siblings scores 0 and GRPO pushes the group apart. Mix it with a quality reward
(`reward=mix reward.mix={clip_score: 1.0, group_diversity: 0.2}`): alone it rewards noise.

The feature model is any transformers checkpoint in a local directory that loads with `AutoModel` and
`AutoImageProcessor` (clip_score.ImageFeatures): a CLIP / SigLIP model (`get_image_features`), or a vision encoder
such as a CLIP vision tower or DINOv2 (`pooler_output`, else the mean of `last_hidden_state` over tokens).
Images go through the checkpoint's own image processor as uint8 RGB. One forward embeds the whole call (every group
in it); the distances are taken within each group only.
"""

from __future__ import annotations

import torch

from .base import (
    RewardOutput,
    check_batch,
    checked_group_ids,
    group_members,
    register_reward,
)
from .clip_score import ImageFeatures


def mean_feature_distance(features: torch.Tensor) -> torch.Tensor:
    """(n, D) features of one group -> (n,) float64: score_i = 1/(n-1) Σ_{j≠i} (1 − cos(f_i, f_j))
    (docs/rewards.md, "group_diversity"). ValueError for a group of fewer than 2."""
    n = features.shape[0]
    if n < 2:
        raise ValueError(f"group_diversity: a group of {n} sample has no other member to differ from "
                         "(set rollout.n >= 2)")
    f = torch.nn.functional.normalize(features.to(torch.float64), dim=-1)
    cos = f @ f.T
    return (1.0 - cos).sum(1) / (n - 1)  # the diagonal adds 1 - 1 = 0


@register_reward("group_diversity")
class GroupDiversity:
    """Mean cosine distance of a sample's features to its group's other members (module docstring)."""

    groupwise = True
    media = ("images",)  # video: frame j of each member is compared with frame j of the others (call_reward)

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32"):
        self.features = ImageFeatures(path, "group_diversity feature model path", lambda h: h.mean(1), device, dtype)

    def __call__(self, images, prompts, metadata=None, group_ids=None) -> RewardOutput:
        n = int(images.shape[0])
        check_batch("group_diversity", n, prompts, metadata)
        group_ids = checked_group_ids(self, group_ids, n)
        feats = self.features(images).cpu()
        scores = torch.empty(n, dtype=torch.float64)
        for members in group_members(group_ids):
            scores[members] = mean_feature_distance(feats[members])
        return RewardOutput(scores.float(), {"group_diversity/group_size": [
            float((group_ids == g).sum()) for g in group_ids.tolist()]})
