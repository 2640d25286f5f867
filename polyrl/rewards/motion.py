"""`motion` reward: programmatic verification of the moving-shapes video task (`polyrl.toy.motion_task`).

No learned model; video in (B, T, 3, H, W). Per frame, objects are found exactly as the `shapes` reward finds
them (palette segmentation, per-colour 8-connected components, shape from compactness and fill ratio; see
`polyrl.rewards.shapes`), with a larger default `min_area` because generated clips have specks. Then, per asked
group g (colour c_g, shape s_g, count n_g, direction u_g, a unit vector with y down), with T frames:

* colour_g = (1/T) · #{frames with at least one object of colour c_g};
* shape_g  = (1/T) · #{frames with at least one object of colour c_g and shape s_g};
* count_g  = (1/T) · #{frames with exactly n_g objects of colour c_g and shape s_g};
* motion_g = clip((d·u_g − |d × u_g|) / (min_travel · W), 0, 1), where d = (T − 1) · v̄ is the displacement over
  the clip of the colour's objects: v̄ is the mean displacement over all links between consecutive frames, a link
  being a mutual nearest-neighbour pair of colour-c_g centroids in frames t and t + 1 at most `max_step` · W apart.
  It is 1 for motion of at least `min_travel` · W along u_g with no sideways drift, and 0 for a static clip, the
  opposite direction, a perpendicular one, or a colour seen in fewer than two consecutive frames.

  score_g = motion_weight · motion_g + (1 − motion_weight) / 3 · (colour_g + shape_g + count_g)

and the clip's score is the mean of score_g over the prompt's groups, in [0, 1]. Tracking uses colour only (the
grammar gives the two objects of a two-group prompt different colours), so a blurred frame in which an object's
shape is misread still contributes its motion. Robustness to blur: frame-wise fractions rather than all-or-nothing
atoms, and links rather than per-frame means (an object missing in one frame removes two links, not a whole clip).
Measured (`tests/test_motion_reward.py`): `render` clips at the toy model's 48 px score ≥ 0.9 crisp and after a
Gaussian blur of radius 0.7 px (120 specs of the grammar), hand-drawn correct clips ≥ 0.9 up to a 1 px blur. At
32 px the shape measures stop separating circles from squares (a 4 px disc fills up to 0.92 of its box), so the
toy model works at 48 px.
"""

from __future__ import annotations

import numpy as np
import torch

from ..toy.motion_task import COLORS, DIRECTIONS, SHAPES, MotionSpec, parse_prompt
from .base import RewardOutput, check_batch, register_reward
from .shapes import Detection, ShapesReward, task_spec


def _links(previous: np.ndarray, current: np.ndarray, max_step: float) -> np.ndarray:
    """Displacements (k, 2) of the mutual nearest-neighbour pairs between two frames' centroids (n, 2) and (m, 2)
    that are at most `max_step` apart."""
    if len(previous) == 0 or len(current) == 0:
        return np.zeros((0, 2))
    dist = np.linalg.norm(previous[:, None, :] - current[None, :, :], axis=-1)
    forward, backward = dist.argmin(1), dist.argmin(0)
    pairs = [(i, j) for i, j in enumerate(forward) if backward[j] == i and dist[i, j] <= max_step]
    return np.array([current[j] - previous[i] for i, j in pairs]).reshape(-1, 2)


def clip_displacement(centroids: list[np.ndarray], max_step: float) -> np.ndarray | None:
    """(T − 1) · mean link displacement of one colour's objects (`centroids[t]`: (n_t, 2) as (x, y)); None when
    there is no link."""
    links = [_links(a, b, max_step) for a, b in zip(centroids, centroids[1:], strict=False)]
    links = np.concatenate(links) if links else np.zeros((0, 2))
    if len(links) == 0:
        return None
    return links.mean(0) * (len(centroids) - 1)


def motion_score(displacement: np.ndarray | None, direction: str, min_travel: float) -> float:
    """clip((d·u − |d × u|) / min_travel, 0, 1) for the asked direction's unit vector u (0 without a track)."""
    if displacement is None:
        return 0.0
    u = np.array(DIRECTIONS[direction], dtype=np.float64)
    along = float(displacement @ u)
    sideways = abs(float(displacement[0] * u[1] - displacement[1] * u[0]))
    return float(np.clip((along - sideways) / min_travel, 0.0, 1.0))


@register_reward("motion")
class MotionReward:
    """Mean over the prompt's groups of colour / shape / count / motion terms on a video (module docstring).

    `min_area`: smallest component kept, in pixels (None: 0.008 · H · W, 8 px at 32x32). `color_threshold`,
    `square_fill`, `triangle_compactness`: the `shapes` reward's detection settings. `min_travel`: displacement
    over the clip, as a fraction of the frame width, that earns the full motion term (rendered clips travel
    0.30..0.45). `max_step`: longest link between consecutive frames, as a fraction of the width.
    `motion_weight`: the motion term's share of a group's score; the other three share the rest equally.
    """

    inputs = "images"
    media = ("video",)

    def __init__(
        self,
        min_area: float | None = None,
        color_threshold: float = 90.0,
        square_fill: float = 0.90,
        triangle_compactness: float = 0.94,
        min_travel: float = 0.15,
        max_step: float = 0.2,
        motion_weight: float = 0.4,
    ):
        if not 0.0 < min_travel <= 1.0 or not 0.0 < max_step <= 1.0:
            raise ValueError(f"need min_travel and max_step in (0, 1], got {min_travel}, {max_step}")
        if not 0.0 <= motion_weight <= 1.0:
            raise ValueError(f"need motion_weight in [0, 1], got {motion_weight}")
        self.min_area = min_area
        self.min_travel, self.max_step, self.motion_weight = float(min_travel), float(max_step), float(motion_weight)
        self._detection = dict(color_threshold=color_threshold, square_fill=square_fill,
                               triangle_compactness=triangle_compactness)
        ShapesReward(**self._detection)  # checks the detection settings now rather than at the first video
        self._detectors: dict[tuple[int, int], ShapesReward] = {}

    def _detector(self, h: int, w: int) -> ShapesReward:
        """The shapes detection with this reward's `min_area` for (h, w) frames (one per frame size)."""
        if (h, w) not in self._detectors:
            min_area = 0.008 * h * w if self.min_area is None else float(self.min_area)
            self._detectors[h, w] = ShapesReward(min_area=min_area, **self._detection)
        return self._detectors[h, w]

    def detect(self, video: torch.Tensor) -> list[list[list[Detection]]]:
        """Detected objects per video and frame, for a (B, T, 3, H, W) video in [0, 1]."""
        if video.ndim != 5 or video.shape[2] != 3:
            raise ValueError(f"motion reward: expected video of shape (B, T, 3, H, W), got {tuple(video.shape)}")
        b, t, _, h, w = video.shape
        per_frame = self._detector(h, w).detect(video.reshape(b * t, 3, h, w))
        return [per_frame[i * t : (i + 1) * t] for i in range(b)]

    @staticmethod
    def _spec(prompt: str, meta: dict | None) -> MotionSpec:
        spec = task_spec(prompt, meta, MotionSpec.from_metadata, parse_prompt, "motion")
        for g in spec.groups:
            if g.color not in COLORS or g.shape not in SHAPES or g.direction not in DIRECTIONS:
                raise ValueError(f"motion reward: unknown colour/shape/direction {g.color!r}/{g.shape!r}/"
                                 f"{g.direction!r} for prompt {prompt!r}")
        return spec

    def _group_terms(self, frames: list[list[Detection]], group, width: int) -> dict[str, float]:
        colour = [[d for d in dets if d.color == group.color] for dets in frames]
        matching = [sum(d.shape == group.shape for d in dets) for dets in colour]
        centroids = [np.array([(d.x, d.y) for d in dets]).reshape(-1, 2) for dets in colour]
        displacement = clip_displacement(centroids, self.max_step * width)
        return {
            "colour": float(np.mean([len(dets) > 0 for dets in colour])),
            "shape": float(np.mean([n > 0 for n in matching])),
            "count": float(np.mean([n == group.count for n in matching])),
            "motion": motion_score(displacement, group.direction, self.min_travel * width),
            "travel": float(displacement @ np.array(DIRECTIONS[group.direction])) / width
            if displacement is not None else 0.0,
        }

    def __call__(self, video: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        metadata = check_batch("motion", int(video.shape[0]), prompts, metadata)
        specs = [self._spec(p, m) for p, m in zip(prompts, metadata, strict=True)]  # bad prompts fail before work
        detections = self.detect(video)
        width = int(video.shape[-1])
        w = self.motion_weight
        scores = np.zeros(len(specs), dtype=np.float32)
        extras: dict[str, list[float]] = {f"motion/{k}_acc": [] for k in ("colour", "shape", "count", "direction")}
        extras["motion/travel"] = []
        for i, (spec, frames) in enumerate(zip(specs, detections, strict=True)):
            terms = [self._group_terms(frames, g, width) for g in spec.groups]
            per_group = [w * t["motion"] + (1 - w) / 3 * (t["colour"] + t["shape"] + t["count"]) for t in terms]
            scores[i] = float(np.mean(per_group))
            for key, term in (("colour", "colour"), ("shape", "shape"), ("count", "count"), ("direction", "motion")):
                extras[f"motion/{key}_acc"].append(float(np.mean([t[term] for t in terms])))
            extras["motion/travel"].append(float(np.mean([t["travel"] for t in terms])))
        return RewardOutput(scores=torch.from_numpy(scores), extras=extras)
