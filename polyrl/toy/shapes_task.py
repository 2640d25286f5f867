"""The procedural "coloured shapes" task behind the embedded default.

A prompt names one or two object groups ("two red circles", "a blue square") and, for two groups, a spatial
relation between them ("... above ..."). The same structure is used three ways: to render training images for
the toy base model (`render`), to write prompt files for RL (`make_prompts`), and to verify generations (the
`shapes` reward parses prompts with `parse_prompt`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
RELATIONS = ("above", "below", "left of", "right of")
_RELATION_TEXT = {"above": "above", "below": "below", "left of": "to the left of", "right of": "to the right of"}


@dataclass(frozen=True)
class ObjectGroup:
    color: str
    shape: str
    count: int

    def text(self) -> str:
        noun = self.shape + ("s" if self.count > 1 else "")
        return f"{COUNT_WORDS[self.count]} {self.color} {noun}"


@dataclass(frozen=True)
class ShapesSpec:
    """What a prompt asks for: one or two groups and an optional relation of group 0 to group 1."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    def text(self) -> str:
        if self.relation is None:
            return self.groups[0].text()
        return f"{self.groups[0].text()} {_RELATION_TEXT[self.relation]} {self.groups[1].text()}"

    def to_metadata(self) -> dict:
        return {
            "groups": [{"color": g.color, "shape": g.shape, "count": g.count} for g in self.groups],
            "relation": self.relation,
        }

    @staticmethod
    def from_metadata(meta: dict) -> ShapesSpec:
        groups = tuple(ObjectGroup(g["color"], g["shape"], int(g["count"])) for g in meta["groups"])
        return ShapesSpec(groups, meta.get("relation"))


def _parse_group(words: list[str]) -> ObjectGroup:
    if len(words) != 3 or words[0] not in WORD_COUNTS or words[1] not in COLORS:
        raise ValueError(f"cannot parse object group {' '.join(words)!r}")
    shape = words[2][:-1] if words[2].endswith("s") else words[2]
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {words[2]!r}; allowed: {', '.join(SHAPES)}")
    return ObjectGroup(words[1], shape, WORD_COUNTS[words[0]])


def parse_prompt(prompt: str) -> ShapesSpec:
    """Inverse of `ShapesSpec.text` (raises ValueError on text outside the grammar)."""
    words = prompt.lower().strip().rstrip(".").split()
    if len(words) == 3:
        return ShapesSpec((_parse_group(words),))
    for relation, text in _RELATION_TEXT.items():
        rel = text.split()
        for i in range(3, len(words) - 3 + 1):
            if words[i : i + len(rel)] == rel and len(words) == 3 + len(rel) + 3:
                return ShapesSpec((_parse_group(words[:3]), _parse_group(words[-3:])), relation)
    raise ValueError(f"prompt outside the shapes grammar: {prompt!r}")


def all_specs() -> list[ShapesSpec]:
    """Every prompt of the grammar (single groups, and relation pairs of differing colour+shape)."""
    groups = [ObjectGroup(c, s, n) for c in COLORS for s in SHAPES for n in COUNT_WORDS]
    specs = [ShapesSpec((g,)) for g in groups]
    pair_groups = [g for g in groups if g.count <= 2]
    for a, b in itertools.permutations(pair_groups, 2):
        if (a.color, a.shape) == (b.color, b.shape):
            continue
        for rel in RELATIONS:
            specs.append(ShapesSpec((a, b), rel))
    return specs


def split_specs(seed: int = 0, heldout_fraction: float = 0.2) -> tuple[list[ShapesSpec], list[ShapesSpec]]:
    """A fixed train / held-out split of the grammar (held-out prompts are never used for RL training)."""
    specs = all_specs()
    rng = random.Random(seed)
    rng.shuffle(specs)
    k = int(len(specs) * heldout_fraction)
    return specs[k:], specs[:k]


# ---------------------------------------------------------------------------------------------- rendering
def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.9
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)


def _region(relation: str | None, which: int, size: int) -> tuple[float, float, float, float]:
    """Box (x0, y0, x1, y1) where group `which` (0 or 1) may be placed so that `relation` holds."""
    full = (0.0, 0.0, float(size), float(size))
    half = size / 2
    if relation is None:
        return full
    first, second = {
        "above": ((0, 0, size, half), (0, half, size, size)),
        "below": ((0, half, size, size), (0, 0, size, half)),
        "left of": ((0, 0, half, size), (half, 0, size, size)),
        "right of": ((half, 0, size, size), (0, 0, half, size)),
    }[relation]
    return tuple(map(float, first if which == 0 else second))


def render(spec: ShapesSpec, size: int = 64, rng: random.Random | None = None, max_tries: int = 200) -> Image.Image:
    """Draw `spec` on a white canvas: non-overlapping shapes at random positions that satisfy the relation."""
    rng = rng or random.Random()
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    r = size * 0.11
    # Squares reach 1.27·r along the diagonal: keep centres far enough apart that no two shapes touch.
    min_dist = 2.6 * r + size * 0.03
    placed: list[tuple[float, float]] = []
    for which, group in enumerate(spec.groups):
        x0, y0, x1, y1 = _region(spec.relation, which, size)
        for _ in range(group.count):
            for _ in range(max_tries):
                cx = rng.uniform(x0 + r + 1, x1 - r - 1)
                cy = rng.uniform(y0 + r + 1, y1 - r - 1)
                if all((cx - px) ** 2 + (cy - py) ** 2 > min_dist**2 for px, py in placed):
                    break
            placed.append((cx, cy))
            _draw_shape(draw, group.shape, cx, cy, r, COLORS[group.color])
    return img


def make_prompts(specs: list[ShapesSpec]) -> list[dict]:
    """Rows for a prompt file: `prompt` plus the structured metadata the reward can use."""
    return [{"prompt": s.text(), **s.to_metadata()} for s in specs]


def to_array(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"), dtype=np.uint8)
