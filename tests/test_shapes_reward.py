"""Tests of the `shapes` reward (polyrl/rewards/shapes.py) on hand-drawn and `render`ed images."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter

from polyrl.rewards import REWARDS, build_reward
from polyrl.rewards.shapes import ShapesReward
from polyrl.toy.shapes_task import COLORS, SHAPES, all_specs, make_prompts, render

WHITE = (255, 255, 255)


# ------------------------------------------------------------------------------------------------ helpers
def draw(objects, size: int = 64, blur: float = 0.0) -> Image.Image:
    """`objects`: (color, shape, cx, cy, r) tuples, drawn on white (square half-side r, triangle apex up)."""
    img = Image.new("RGB", (size, size), WHITE)
    d = ImageDraw.Draw(img)
    for color, shape, cx, cy, r in objects:
        fill = COLORS[color] if isinstance(color, str) else color
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "triangle":
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        else:
            raise ValueError(shape)
    if blur:
        img = img.filter(ImageFilter.GaussianBlur(blur))
    return img


def to_tensor(imgs) -> torch.Tensor:
    if isinstance(imgs, Image.Image):
        imgs = [imgs]
    return torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).float() / 255 for im in imgs])


def score(reward, img, prompt, meta=None):
    out = reward(to_tensor(img), [prompt], [meta or {}])
    return out.scores[0].item(), {k: v[0] for k, v in out.extras.items()}


@pytest.fixture(scope="module")
def reward():
    return ShapesReward()


# a layout for 'two red circles above a blue square'
TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE = [
    ("red", "circle", 16, 14, 7),
    ("red", "circle", 46, 16, 7),
    ("blue", "square", 32, 48, 7),
]
PROMPT = "two red circles above a blue square"


# ------------------------------------------------------------------------------------------------ registry
def test_registered_and_buildable():
    assert REWARDS["shapes"] is ShapesReward
    r = build_reward({"name": "shapes", "color_threshold": 80.0, "min_area": 10})
    assert isinstance(r, ShapesReward) and r.color_threshold == 80.0 and r.min_area == 10


# ------------------------------------------------------------------------------------------------ atoms
def test_correct_image_scores_one(reward):
    s, ex = score(reward, draw(TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE), PROMPT)
    assert s == 1.0
    assert ex["shapes/present_acc"] == 1.0 and ex["shapes/count_acc"] == 1.0 and ex["shapes/relation_acc"] == 1.0
    assert ex["shapes/num_objects"] == 3


def test_output_types(reward):
    imgs = to_tensor([draw(TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE), draw([])])
    out = reward(imgs, [PROMPT, "a red circle"], [{}, {}])
    assert out.scores.dtype == torch.float32 and out.scores.shape == (2,)
    for k in ("shapes/present_acc", "shapes/count_acc", "shapes/relation_acc", "shapes/num_objects"):
        assert len(out.extras[k]) == 2
    assert math.isnan(out.extras["shapes/relation_acc"][1])  # no relation in the prompt
    # metadata=None and low-precision input are accepted
    assert reward(imgs.half(), [PROMPT, "a red circle"], None).scores.tolist() == out.scores.tolist()


def test_wrong_count_one_missing(reward):
    # only one red circle: present ok, count wrong, blue present ok, count ok, relation ok -> 4/5
    s, ex = score(reward, draw(TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE[1:]), PROMPT)
    assert s == pytest.approx(4 / 5)
    assert ex["shapes/present_acc"] == 1.0 and ex["shapes/count_acc"] == 0.5 and ex["shapes/relation_acc"] == 1.0


def test_wrong_count_extra_object(reward):
    img = draw([("red", "circle", 16, 16, 7), ("red", "circle", 46, 46, 7)])
    assert score(reward, img, "a red circle")[0] == pytest.approx(1 / 2)
    three = [("yellow", "triangle", 12, 14, 7), ("yellow", "triangle", 48, 14, 7), ("yellow", "triangle", 30, 46, 7)]
    assert score(reward, draw(three), "three yellow triangles")[0] == 1.0
    assert score(reward, draw(three[:2]), "three yellow triangles")[0] == pytest.approx(1 / 2)
    assert score(reward, draw(three), "two yellow triangles")[0] == pytest.approx(1 / 2)


def test_wrong_colour(reward):
    # blue square drawn green: group 1 absent -> present x, count x, relation x (absent) -> 2/5
    objs = TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE[:2] + [("green", "square", 32, 48, 7)]
    s, ex = score(reward, draw(objs), PROMPT)
    assert s == pytest.approx(2 / 5)
    assert ex["shapes/present_acc"] == 0.5 and ex["shapes/count_acc"] == 0.5 and ex["shapes/relation_acc"] == 0.0
    assert score(reward, draw([("red", "triangle", 32, 32, 8)]), "a green triangle")[0] == 0.0


def test_wrong_shape(reward):
    # blue square drawn as a blue circle -> 2/5; red circles drawn as triangles -> 2/5
    objs = TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE[:2] + [("blue", "circle", 32, 48, 7)]
    assert score(reward, draw(objs), PROMPT)[0] == pytest.approx(2 / 5)
    objs = [("red", "triangle", 16, 14, 7), ("red", "triangle", 46, 16, 7), ("blue", "square", 32, 48, 7)]
    assert score(reward, draw(objs), PROMPT)[0] == pytest.approx(2 / 5)
    assert score(reward, draw([("blue", "circle", 32, 32, 8)]), "a blue triangle")[0] == 0.0
    assert score(reward, draw([("blue", "circle", 32, 32, 8)]), "a blue square")[0] == 0.0


def test_swapped_relation(reward):
    swapped = [(c, s, x, 64 - y, r) for c, s, x, y, r in TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE]  # mirror vertically
    s, ex = score(reward, draw(swapped), PROMPT)
    assert s == pytest.approx(4 / 5)
    assert ex["shapes/relation_acc"] == 0.0 and ex["shapes/count_acc"] == 1.0
    assert score(reward, draw(swapped), "two red circles below a blue square")[0] == 1.0


@pytest.mark.parametrize(
    "relation,holds",
    [("above", True), ("below", False), ("to the left of", True), ("to the right of", False)],
)
def test_relations_diagonal(reward, relation, holds):
    img = draw([("green", "circle", 14, 30, 7), ("yellow", "square", 48, 34, 7)])  # circle left and higher
    s, ex = score(reward, img, f"a green circle {relation} a yellow square")
    assert ex["shapes/relation_acc"] == float(holds)
    assert s == pytest.approx(1.0 if holds else 4 / 5)


@pytest.mark.parametrize("relation", ["above", "below", "to the left of", "to the right of"])
def test_relations_vertical(reward, relation):
    img = draw([("red", "square", 32, 50, 7), ("blue", "triangle", 32, 14, 7)])  # square directly below
    s, _ = score(reward, img, f"a red square {relation} a blue triangle")
    assert s == pytest.approx(1.0 if relation == "below" else 4 / 5)


def test_relation_uses_mean_centroid(reward):
    # one red circle above the square, one below it; their mean (y=28) is above the square (y=34)
    img = draw([("red", "circle", 12, 8, 6), ("red", "circle", 52, 48, 6), ("blue", "square", 32, 34, 6)])
    assert score(reward, img, "two red circles above a blue square")[0] == 1.0
    assert score(reward, img, "two red circles below a blue square")[0] == pytest.approx(4 / 5)


def test_blank_image_scores_zero(reward):
    blank = draw([])
    for prompt in ("a red circle", "three blue squares", PROMPT, "a yellow triangle to the left of two green circles"):
        s, ex = score(reward, blank, prompt)
        assert s == 0.0
        assert ex["shapes/num_objects"] == 0
    assert score(reward, blank, PROMPT)[1]["shapes/relation_acc"] == 0.0
    # pure black / uniform off-palette grey also have no objects
    assert score(reward, Image.new("RGB", (64, 64), (128, 128, 128)), "a red circle")[0] == 0.0


def test_noise_and_off_palette_ignored(reward):
    objs = TWO_RED_CIRCLES_ABOVE_BLUE_SQUARE + [
        ("red", "square", 4, 60, 1),  # 3x3 speck, below min_area
        ("blue", "circle", 60, 4, 1),
        ((128, 128, 128), "square", 56, 48, 6),  # grey: far from every palette colour
        ((255, 230, 230), "circle", 8, 40, 6),  # pale pink: nearest is the background
    ]
    s, ex = score(reward, draw(objs), PROMPT)
    assert s == 1.0 and ex["shapes/num_objects"] == 3


def test_min_area_parameter():
    img = draw([("red", "circle", 32, 32, 4)])  # ~50 px
    assert score(ShapesReward(min_area=10), img, "a red circle")[0] == 1.0
    assert score(ShapesReward(min_area=100), img, "a red circle")[0] == 0.0


def test_distinct_colours_do_not_merge(reward):
    # touching shapes of different colours are separate components
    img = draw([("red", "square", 24, 32, 8), ("blue", "square", 40, 32, 8)])
    assert score(reward, img, "a red square to the left of a blue square")[0] == 1.0


# ------------------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("color", list(COLORS))
def test_single_shape_classification_sizes(reward, shape, color):
    cases = [(64, r, 0.0) for r in (4, 6, 8, 12, 16, 24)]
    cases += [(64, r, 1.0) for r in (6, 8, 12, 16, 24)]  # blurred
    cases += [(128, r, b) for r in (8, 16, 32) for b in (0.0, 1.0)]
    imgs, sizes = [], []
    for size, r, blur in cases:
        c = size / 2 + 0.3
        imgs.append(draw([(color, shape, c, c + 0.2, r)], size=size, blur=blur))
        sizes.append(size)
    for size in (64, 128):
        batch = [im for im, s in zip(imgs, sizes, strict=False) if s == size]
        which = [case for case in cases if case[0] == size]
        for case, dets in zip(which, reward.detect(to_tensor(batch)), strict=False):
            assert [(d.color, d.shape) for d in dets] == [(color, shape)], (case, dets)


def test_render_shape_classification(reward):
    """The task's own renderer (square half-side 0.9 r, flatter triangle) at several canvas sizes."""
    rng = random.Random(3)
    from polyrl.toy.shapes_task import ObjectGroup, ShapesSpec

    for size in (64, 96, 128):
        specs = [ShapesSpec((ObjectGroup(c, s, 1),)) for c in COLORS for s in SHAPES]
        for blur in (0.0, 1.0):
            imgs = [render(sp, size=size, rng=rng) for sp in specs]
            if blur:
                imgs = [im.filter(ImageFilter.GaussianBlur(blur)) for im in imgs]
            for sp, dets in zip(specs, reward.detect(to_tensor(imgs)), strict=False):
                g = sp.groups[0]
                assert [(d.color, d.shape) for d in dets] == [(g.color, g.shape)], (size, blur, sp, dets)


def test_small_blurred_triangles(reward):
    """Small blurred triangles (fill ratio up to ~0.7, overlapping circles') are still triangles."""
    from polyrl.toy.shapes_task import ObjectGroup, ShapesSpec

    rng = random.Random(5)
    for size in (32, 48):
        specs = [ShapesSpec((ObjectGroup(c, "triangle", 1),)) for c in COLORS for _ in range(5)]
        imgs = [render(sp, size=size, rng=rng).filter(ImageFilter.GaussianBlur(1)) for sp in specs]
        for sp, dets in zip(specs, reward.detect(to_tensor(imgs)), strict=False):
            assert [(d.color, d.shape) for d in dets] == [(sp.groups[0].color, "triangle")], (size, dets)


@pytest.mark.parametrize("angle", [20, 45, 90, 135])
def test_rotated_triangle_is_triangle(reward, angle):
    """The triangle test (moment compactness) does not depend on the orientation."""
    a = np.deg2rad(angle + np.array([-90.0, 30.0, 150.0]))
    pts = [(32 + 10 * np.cos(t), 32 + 10 * np.sin(t)) for t in a]
    img = Image.new("RGB", (64, 64), WHITE)
    ImageDraw.Draw(img).polygon(pts, fill=COLORS["green"])
    dets = reward.detect(to_tensor(img))[0]
    assert [(d.color, d.shape) for d in dets] == [("green", "triangle")], dets


def test_detection_centroid(reward):
    det = reward.detect(to_tensor(draw([("green", "square", 20, 40, 5)])))[0]
    assert len(det) == 1
    assert det[0].x == pytest.approx(20, abs=0.51) and det[0].y == pytest.approx(40, abs=0.51)
    assert det[0].area == 121 and det[0].fill == 1.0


# ------------------------------------------------------------------------------------------------ render
def _render_batch(n: int, seed: int, blur: float = 0.0):
    rng = random.Random(seed)
    specs = rng.sample(all_specs(), n)
    imgs = [render(s, size=64, rng=rng) for s in specs]
    if blur:
        imgs = [im.filter(ImageFilter.GaussianBlur(blur)) for im in imgs]
    return specs, to_tensor(imgs)


def test_render_scores_one(reward):
    specs, imgs = _render_batch(50, seed=0)
    out = reward(imgs, [s.text() for s in specs], [{}] * len(specs))
    bad = [(s.text(), v) for s, v in zip(specs, out.scores.tolist(), strict=False) if v != 1.0]
    assert not bad, bad


def test_blurred_render_scores_high(reward):
    specs, imgs = _render_batch(100, seed=1, blur=1.0)
    out = reward(imgs, [s.text() for s in specs], [{}] * len(specs))
    assert out.scores.mean().item() >= 0.97
    assert (out.scores == 1.0).float().mean().item() >= 0.95


def test_metadata_path_equals_prompt_path(reward):
    specs, imgs = _render_batch(40, seed=2)
    rows = make_prompts(specs)
    by_prompt = reward(imgs, [r["prompt"] for r in rows], [{} for _ in rows])
    by_meta = reward(imgs, [r["prompt"] for r in rows], rows)
    assert torch.equal(by_prompt.scores, by_meta.scores)
    for k in by_prompt.extras:
        np.testing.assert_array_equal(np.asarray(by_prompt.extras[k]), np.asarray(by_meta.extras[k]))
    # metadata wins over the prompt text (which then need not parse)
    meta = specs[0].to_metadata()
    assert reward(imgs[:1], ["not a shapes prompt at all"], [meta]).scores[0] == by_meta.scores[0]
    # and metadata asking for something else changes the score
    other = {"groups": [{"color": "red", "shape": "circle", "count": 3}], "relation": None}
    if not (len(specs[0].groups) == 1 and specs[0].groups[0].color == "red" and specs[0].groups[0].shape == "circle"):
        assert reward(imgs[:1], [rows[0]["prompt"]], [other]).scores[0] == 0.0


@pytest.mark.parametrize(
    "prompt", ["a purple hexagon", "a cat sitting on a mat", "", "two red circles beside a blue square"]
)
def test_unparseable_prompt_raises(reward, prompt):
    with pytest.raises(ValueError) as e:
        reward(to_tensor(draw([])), [prompt], [{}])
    assert repr(prompt) in str(e.value)


def test_bad_metadata_raises(reward):
    with pytest.raises(ValueError, match="purple"):
        reward(to_tensor(draw([])), ["x"], [{"groups": [{"color": "purple", "shape": "circle", "count": 1}]}])
