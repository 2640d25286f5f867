"""`shapes` reward: GenEval-style programmatic verification of the coloured-shapes task.

No learned model. Each image is segmented by colour, its objects are found as connected components and
classified by shape, and the prompt's requirements ("atoms") are checked:

* per object group: `present` (at least one object of that colour+shape) and `count` (exactly the asked
  number of objects of that colour+shape);
* for two-group prompts: `relation` (the mean centroid of group 0's objects is above / below / left of /
  right of group 1's; false if either group is absent).

The score is the fraction of atoms satisfied.

Detection, per image:

1. every pixel goes to the nearest of the palette colours or the white background (Euclidean RGB distance,
   0..255 scale); a pixel farther than `color_threshold` from its nearest colour counts as background (this
   drops anti-aliased / blurred edge pixels and off-palette colours);
2. per colour, 8-connected components; components smaller than `min_area` pixels are dropped as noise;
3. each component's shape comes from two scale-free measures:
   * compactness = area / (4 pi sqrt(det C)), C the covariance of the component's pixel coordinates (plus
     1/12 per axis for the pixel extent): 1 for a disc, 0.955 for a square, ~0.83 for the rendered
     triangle. Below `triangle_compactness` the component is a triangle;
   * otherwise the fill ratio, area / bounding-box area (square ~1, circle ~pi/4), splits square
     (>= `square_fill`) from circle.
   Measured on `polyrl.toy.shapes_task.render` output at 32..128 px, crisp and after a radius-1 Gaussian blur
   (blur shrinks and rounds the detected masks): triangle compactness <= 0.93, circle/square >= 0.955;
   at 64 px blurred, circle fill 0.66-0.87 and square fill >= 0.93 (crisp: circle 0.75-0.81, square 1.0).
   The compactness is used for triangles because the fill ratio of small blurred triangles (up to 0.69)
   overlaps that of small blurred circles (down to 0.60).

Known limit: same-coloured objects that touch merge into one component (mis-shaped, so the group's count and
often its presence fail). `render` allows this for squares placed diagonally (its spacing check is on
centre distance), in about 0.4% of crisp 64 px renders.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from ..toy.shapes_task import BACKGROUND, COLORS, SHAPES, ShapesSpec, parse_prompt
from .base import RewardOutput, register_reward

_COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
# palette index 0 is the background, 1.. are the colours in `_COLOR_NAMES` order
_PALETTE = np.array([BACKGROUND] + [COLORS[c] for c in _COLOR_NAMES], dtype=np.float32)
_SHAPE_INDEX = {s: i for i, s in enumerate(SHAPES)}
_COLOR_INDEX = {c: i for i, c in enumerate(_COLOR_NAMES)}
# 8-connectivity inside each image, no connectivity across the batch axis
_STRUCTURE = np.zeros((3, 3, 3), dtype=bool)
_STRUCTURE[1] = True


@dataclass(frozen=True)
class Detection:
    """One detected object: colour and shape names, centroid (x right, y down, pixels), area, fill ratio,
    compactness (see the module docstring)."""

    color: str
    shape: str
    x: float
    y: float
    area: int
    fill: float
    compactness: float


def _relation_holds(relation: str, c0: np.ndarray, c1: np.ndarray) -> bool:
    """`c0`, `c1`: mean centroids (y, x) of group 0 and group 1; image y grows downward."""
    (y0, x0), (y1, x1) = c0, c1
    if relation == "above":
        return bool(y0 < y1)
    if relation == "below":
        return bool(y0 > y1)
    if relation == "left of":
        return bool(x0 < x1)
    if relation == "right of":
        return bool(x0 > x1)
    raise ValueError(f"unknown relation {relation!r}")


def task_spec(prompt: str, meta: dict | None, from_metadata, parse, reward: str):
    """A toy task's spec of one sample (`shapes`, `motion`): from its metadata's `groups` where the row has them,
    else parsed from the prompt by the task's grammar (a ValueError naming `reward` for text outside it)."""
    if meta and "groups" in meta:
        return from_metadata(meta)
    try:
        return parse(prompt)
    except ValueError as e:
        raise ValueError(f"{reward} reward cannot parse prompt {prompt!r}: {e}") from e


@register_reward("shapes")
class ShapesReward:
    """Fraction of the prompt's present / count / relation atoms that the detected objects satisfy.

    `min_area`: smallest component kept, in pixels (None: 0.004 * H * W, about 16 px at 64x64).
    `color_threshold`: largest RGB distance (0..255 scale) from a palette colour for a pixel to count.
    `triangle_compactness`: compactness below this is a triangle; `square_fill`: otherwise a fill ratio at
    or above this is a square, below it a circle (see the module docstring).
    """

    def __init__(
        self,
        min_area: float | None = None,
        color_threshold: float = 90.0,
        square_fill: float = 0.90,
        triangle_compactness: float = 0.94,
    ):
        if not 0.0 < square_fill <= 1.0 or not 0.0 < triangle_compactness <= 1.0:
            raise ValueError(
                f"need square_fill and triangle_compactness in (0, 1], got {square_fill}, {triangle_compactness}"
            )
        self.min_area = min_area
        self.color_threshold = float(color_threshold)
        self.square_fill = float(square_fill)
        self.triangle_compactness = float(triangle_compactness)

    # ------------------------------------------------------------------------------------------ detection
    def _classify(self, fill: np.ndarray, compactness: np.ndarray) -> np.ndarray:
        shape = np.full(fill.shape, _SHAPE_INDEX["circle"], dtype=np.int64)
        shape[fill >= self.square_fill] = _SHAPE_INDEX["square"]
        shape[compactness < self.triangle_compactness] = _SHAPE_INDEX["triangle"]
        return shape

    def _components(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        """All kept components of the batch as flat arrays: batch index, colour index, shape index, centroid
        (y, x), area, fill ratio."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images of shape (B, 3, H, W), got {tuple(images.shape)}")
        _, _, h, w = images.shape
        x = images.detach().to("cpu", torch.float32).clamp(0.0, 1.0).mul(255.0).permute(0, 2, 3, 1).numpy()
        # squared distances to the palette via |x|^2 - 2 x.p + |p|^2 (no (B,H,W,K,3) temporary)
        d2 = (x * x).sum(-1, keepdims=True) - 2.0 * (x @ _PALETTE.T) + (_PALETTE * _PALETTE).sum(-1)
        cls = d2.argmin(-1)
        cls[d2.min(-1) > self.color_threshold**2] = 0

        min_area = 0.004 * h * w if self.min_area is None else float(self.min_area)
        names = ("batch", "color", "shape", "cy", "cx", "area", "fill", "compactness")
        parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
        ys = np.broadcast_to(np.arange(h, dtype=np.float64)[None, :, None], cls.shape).ravel()
        xs = np.broadcast_to(np.arange(w, dtype=np.float64)[None, None, :], cls.shape).ravel()
        for ci in range(len(_COLOR_NAMES)):
            lab, n = ndimage.label(cls == ci + 1, structure=_STRUCTURE)
            if n == 0:
                continue
            flat = lab.ravel()
            area = np.bincount(flat, minlength=n + 1)[1:]
            keep = np.flatnonzero(area >= min_area)
            if keep.size == 0:
                continue
            a = area[keep].astype(np.float64)
            # per-component means of y, x, y^2, x^2, x*y over the kept components
            cy, cx, myy, mxx, mxy = (
                np.bincount(flat, weights=wt, minlength=n + 1)[1:][keep] / a
                for wt in (ys, xs, ys * ys, xs * xs, ys * xs)
            )
            vyy = myy - cy * cy + 1.0 / 12.0
            vxx = mxx - cx * cx + 1.0 / 12.0
            vxy = mxy - cy * cx
            det = np.maximum(vyy * vxx - vxy * vxy, 1e-12)
            compactness = a / (4.0 * np.pi * np.sqrt(det))
            slices = ndimage.find_objects(lab)
            boxes = np.array(
                [(s[0].start, s[1].stop - s[1].start, s[2].stop - s[2].start) for s in (slices[i] for i in keep)],
                dtype=np.int64,
            ).reshape(-1, 3)
            fill = area[keep] / (boxes[:, 1] * boxes[:, 2])
            parts["batch"].append(boxes[:, 0])
            parts["color"].append(np.full(keep.size, ci, dtype=np.int64))
            parts["shape"].append(self._classify(fill, compactness))
            parts["cy"].append(cy)
            parts["cx"].append(cx)
            parts["area"].append(area[keep])
            parts["fill"].append(fill)
            parts["compactness"].append(compactness)
        empty = {"batch": np.int64, "color": np.int64, "shape": np.int64, "area": np.int64}
        return {k: np.concatenate(v) if v else np.zeros(0, dtype=empty.get(k, np.float64)) for k, v in parts.items()}

    def detect(self, images: torch.Tensor) -> list[list[Detection]]:
        """Detected objects per image (for diagnostics and tests)."""
        comp = self._components(images)
        out: list[list[Detection]] = [[] for _ in range(images.shape[0])]
        for i in range(comp["batch"].size):
            out[int(comp["batch"][i])].append(
                Detection(
                    color=_COLOR_NAMES[comp["color"][i]],
                    shape=SHAPES[comp["shape"][i]],
                    x=float(comp["cx"][i]),
                    y=float(comp["cy"][i]),
                    area=int(comp["area"][i]),
                    fill=float(comp["fill"][i]),
                    compactness=float(comp["compactness"][i]),
                )
            )
        return out

    # ------------------------------------------------------------------------------------------ scoring
    @staticmethod
    def _spec(prompt: str, meta: dict | None) -> ShapesSpec:
        spec = task_spec(prompt, meta, ShapesSpec.from_metadata, parse_prompt, "shapes")
        for g in spec.groups:
            if g.color not in _COLOR_INDEX or g.shape not in _SHAPE_INDEX:
                raise ValueError(f"shapes reward: unknown colour/shape {g.color!r}/{g.shape!r} for prompt {prompt!r}")
        if spec.relation is not None and len(spec.groups) != 2:
            raise ValueError(f"shapes reward: a relation needs exactly two groups (prompt {prompt!r})")
        return spec

    def check_prompt(self, prompt: str, meta: dict | None = None) -> None:
        """ValueError when this reward could not score `prompt` (the trainer checks every data row before it
        starts, so a bad row is reported with its file and line rather than mid-run)."""
        self._spec(prompt, meta)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        bsz = images.shape[0]
        if len(prompts) != bsz:
            raise ValueError(f"got {bsz} images but {len(prompts)} prompts")
        metadata = list(metadata) if metadata is not None else [{}] * bsz
        if len(metadata) != bsz:
            raise ValueError(f"got {bsz} images but {len(metadata)} metadata entries")
        specs = [self._spec(p, m) for p, m in zip(prompts, metadata, strict=False)]  # parse first: bad prompts fail fast

        comp = self._components(images)
        nc, ns = len(_COLOR_NAMES), len(SHAPES)
        key = (comp["batch"] * nc + comp["color"]) * ns + comp["shape"]
        counts = np.bincount(key, minlength=bsz * nc * ns).reshape(bsz, nc, ns)
        sum_y = np.bincount(key, weights=comp["cy"], minlength=bsz * nc * ns).reshape(bsz, nc, ns)
        sum_x = np.bincount(key, weights=comp["cx"], minlength=bsz * nc * ns).reshape(bsz, nc, ns)
        num_objects = np.bincount(comp["batch"], minlength=bsz)

        scores = np.zeros(bsz, dtype=np.float32)
        present_acc: list[float] = []
        count_acc: list[float] = []
        relation_acc: list[float] = []
        for i, spec in enumerate(specs):
            present, exact, centroids = [], [], []
            for g in spec.groups:
                ci, si = _COLOR_INDEX[g.color], _SHAPE_INDEX[g.shape]
                n = int(counts[i, ci, si])
                present.append(n >= 1)
                exact.append(n == g.count)
                centroids.append(np.array([sum_y[i, ci, si], sum_x[i, ci, si]]) / n if n else None)
            atoms = present + exact
            if spec.relation is not None:
                ok = all(c is not None for c in centroids) and _relation_holds(spec.relation, *centroids)
                atoms.append(ok)
                relation_acc.append(float(ok))
            else:
                relation_acc.append(float("nan"))
            scores[i] = sum(atoms) / len(atoms)
            present_acc.append(sum(present) / len(present))
            count_acc.append(sum(exact) / len(exact))

        return RewardOutput(
            scores=torch.from_numpy(scores),
            extras={
                "shapes/present_acc": present_acc,
                "shapes/count_acc": count_acc,
                "shapes/relation_acc": relation_acc,
                "shapes/num_objects": [int(n) for n in num_objects],
            },
        )
