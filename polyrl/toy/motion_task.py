"""The procedural "moving shapes" task behind the toy video default.

A prompt names one group of objects and where it moves ("a red circle moving left", "two blue squares moving
up"), or two single objects of different colours, each with its own motion ("a green triangle moving right and a
yellow circle moving down"). Colours and shapes are the shapes task's (same palette, same drawing), so the video
reward can reuse its per-frame detection. The same structure is used three ways: to render training clips for the
toy video model (`render`), to write prompt files for RL (`make_prompts`), and to verify generations (the `motion`
reward parses prompts with `parse_prompt`).

The grammar is kept small enough for a tiny model: 4 colours x 3 shapes x {1, 2} objects x 4 directions = 96
one-group prompts, and 48 x 36 = 1728 ordered two-object pairs of different colours.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

# the shapes task's palette and geometry, so that the shapes detection applies unchanged
from .shapes_task import BACKGROUND, COLORS, SHAPES, _draw_shape

# unit motion (dx, dy) per direction word; image y grows downward
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
COUNT_WORDS = {1: "a", 2: "two"}
WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2}
RADIUS = 0.12  # object radius as a fraction of the frame size
TRAVEL = (0.30, 0.45)  # distance an object covers over the whole clip, as a fraction of the frame size
SUPERSAMPLE = 4  # draw at 4x and box-downsample: sub-pixel motion and soft edges instead of a 1-pixel jitter


@dataclass(frozen=True)
class MovingGroup:
    color: str
    shape: str
    count: int
    direction: str

    def text(self) -> str:
        noun = self.shape + ("s" if self.count > 1 else "")
        return f"{COUNT_WORDS[self.count]} {self.color} {noun} moving {self.direction}"


@dataclass(frozen=True)
class MotionSpec:
    """What a prompt asks for: one or two moving groups."""

    groups: tuple[MovingGroup, ...]

    def text(self) -> str:
        return " and ".join(g.text() for g in self.groups)

    def to_metadata(self) -> dict:
        return {"groups": [{"color": g.color, "shape": g.shape, "count": g.count, "direction": g.direction}
                           for g in self.groups]}

    @staticmethod
    def from_metadata(meta: dict) -> MotionSpec:
        return MotionSpec(tuple(MovingGroup(g["color"], g["shape"], int(g["count"]), g["direction"])
                                for g in meta["groups"]))


def _parse_group(words: list[str]) -> MovingGroup:
    text = " ".join(words)
    if len(words) != 5 or words[0] not in WORD_COUNTS or words[1] not in COLORS or words[3] != "moving":
        raise ValueError(f"cannot parse moving group {text!r} (expected e.g. 'a red circle moving left')")
    shape = words[2][:-1] if words[2].endswith("s") else words[2]
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {words[2]!r} in {text!r}; allowed: {', '.join(SHAPES)}")
    if words[4] not in DIRECTIONS:
        raise ValueError(f"unknown direction {words[4]!r} in {text!r}; allowed: {', '.join(DIRECTIONS)}")
    return MovingGroup(words[1], shape, WORD_COUNTS[words[0]], words[4])


def parse_prompt(prompt: str) -> MotionSpec:
    """Inverse of `MotionSpec.text` (raises ValueError on text outside the grammar)."""
    words = prompt.lower().strip().rstrip(".").split()
    if len(words) == 5:
        return MotionSpec((_parse_group(words),))
    if len(words) == 11 and words[5] == "and":
        return MotionSpec((_parse_group(words[:5]), _parse_group(words[6:])))
    raise ValueError(f"prompt outside the motion grammar: {prompt!r}")


def all_specs() -> list[MotionSpec]:
    """Every prompt of the grammar: one group (1 or 2 objects), and ordered pairs of single objects of different
    colours (a different colour per object keeps each object's track unambiguous for the reward)."""
    groups = [MovingGroup(c, s, n, d) for c in COLORS for s in SHAPES for n in COUNT_WORDS for d in DIRECTIONS]
    specs = [MotionSpec((g,)) for g in groups]
    singles = [g for g in groups if g.count == 1]
    specs += [MotionSpec((a, b)) for a in singles for b in singles if a.color != b.color]
    return specs


def split_specs(seed: int = 0, heldout_fraction: float = 0.2) -> tuple[list[MotionSpec], list[MotionSpec]]:
    """A fixed train / held-out split of the grammar (held-out prompts are never used for RL training).

    One-group and two-object prompts are split separately, so both kinds are held out in the same proportion."""
    rng = random.Random(seed)
    train, heldout = [], []
    for kind in (1, 2):
        specs = [s for s in all_specs() if len(s.groups) == kind]
        rng.shuffle(specs)
        k = int(len(specs) * heldout_fraction)
        heldout += specs[:k]
        train += specs[k:]
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout


def make_prompts(specs: list[MotionSpec]) -> list[dict]:
    """Rows for a prompt file: `prompt` plus the structured metadata the reward can use."""
    return [{"prompt": s.text(), **s.to_metadata()} for s in specs]


# ---------------------------------------------------------------------------------------------- rendering
def _tracks(spec: MotionSpec, frames: int, size: int, rng: random.Random, max_tries: int = 500) -> list[np.ndarray]:
    """One (frames, 2) array of centres (x, y) per object: straight lines at one speed per clip, every object
    inside the frame at every frame and no two objects closer than `min_dist` at any frame."""
    r = RADIUS * size
    # pixel i covers [i - 0.5, i + 0.5]: keep every object 1.5 px clear of the frame's edges
    lo, hi = r + 1.0, size - 2.0 - r
    # squares reach 1.27 r along the diagonal: centres this far apart never touch
    min_dist = 2.6 * r + 0.03 * size
    travel = rng.uniform(*TRAVEL) * size
    t = np.linspace(0.0, 1.0, frames)[:, None]
    for _ in range(max_tries):
        tracks: list[np.ndarray] = []
        for group in spec.groups:
            step = np.array(DIRECTIONS[group.direction], dtype=np.float64) * travel
            for _ in range(group.count):
                # start so that start + step stays in [lo, hi] on both axes
                start = np.array([rng.uniform(max(lo, lo - s), min(hi, hi - s)) for s in step])
                tracks.append(start + t * step)
        if all(np.linalg.norm(a - b, axis=1).min() > min_dist
               for i, a in enumerate(tracks) for b in tracks[i + 1:]):
            return tracks
    raise RuntimeError(f"could not place {spec.text()!r} without overlap in {max_tries} tries at {size}px")


def render(spec: MotionSpec, frames: int = 9, size: int = 32, rng: random.Random | None = None) -> np.ndarray:
    """A clip (frames, size, size, 3) uint8 of `spec` on white: each object moves in a straight line, in its
    group's direction, by `TRAVEL` x size over the clip, from a random start (all objects of a clip at one speed)."""
    rng = rng or random.Random()
    tracks = _tracks(spec, frames, size, rng)
    fills = [COLORS[g.color] for g in spec.groups for _ in range(g.count)]
    shapes = [g.shape for g in spec.groups for _ in range(g.count)]
    big, r = size * SUPERSAMPLE, RADIUS * size * SUPERSAMPLE
    clip = np.empty((frames, size, size, 3), dtype=np.uint8)
    for f in range(frames):
        img = Image.new("RGB", (big, big), BACKGROUND)
        draw = ImageDraw.Draw(img)
        for track, shape, fill in zip(tracks, shapes, fills, strict=True):
            x, y = (track[f] + 0.5) * SUPERSAMPLE - 0.5  # pixel centres of the small frame in the big one
            _draw_shape(draw, shape, x, y, r, fill)
        clip[f] = np.asarray(img.reduce(SUPERSAMPLE), dtype=np.uint8)
    return clip
