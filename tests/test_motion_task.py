"""The moving-shapes task (polyrl/toy/motion_task.py): grammar, split, and the renderer, checked against pixel
measurements made here (colour masks), independently of the `motion` reward's detection."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from polyrl.toy.motion_task import (
    COLORS,
    DIRECTIONS,
    RADIUS,
    TRAVEL,
    MotionSpec,
    MovingGroup,
    all_specs,
    make_prompts,
    parse_prompt,
    render,
    split_specs,
)


def colour_mask(frame: np.ndarray, color: str, tol: float = 60.0) -> np.ndarray:
    return np.linalg.norm(frame.astype(np.float64) - np.array(COLORS[color]), axis=-1) < tol


def test_grammar_round_trips_through_text_and_metadata():
    specs = all_specs()
    assert len(specs) == 4 * 3 * 2 * 4 + 48 * 36 == len(set(specs))
    for spec in specs:
        assert parse_prompt(spec.text()) == spec
        assert MotionSpec.from_metadata(json.loads(json.dumps(spec.to_metadata()))) == spec
    assert parse_prompt("two blue squares moving up") == MotionSpec((MovingGroup("blue", "square", 2, "up"),))
    assert parse_prompt("A green triangle moving right and a yellow circle moving down.") == MotionSpec((
        MovingGroup("green", "triangle", 1, "right"), MovingGroup("yellow", "circle", 1, "down")))
    assert all(s.groups[0].color != s.groups[1].color for s in specs if len(s.groups) == 2)


@pytest.mark.parametrize("bad", ["a red circle", "a red circle moving sideways", "a purple circle moving up",
                                 "a red hexagon moving up", "three red circles moving up",
                                 "a red circle moving up or a blue square moving down"])
def test_parse_rejects_text_outside_the_grammar(bad):
    with pytest.raises(ValueError):
        parse_prompt(bad)


def test_split_is_disjoint_reproducible_and_keeps_both_kinds():
    train, held = split_specs(0)
    assert not set(train) & set(held) and len(train) + len(held) == len(all_specs())
    assert (train, held) == split_specs(0) and held != split_specs(1)[1]
    for kind, total in ((1, 96), (2, 1728)):
        assert sum(len(s.groups) == kind for s in held) == int(total * 0.2)
    rows = make_prompts(held[:3])
    assert [r["prompt"] for r in rows] == [s.text() for s in held[:3]]
    assert all(MotionSpec.from_metadata(r) == s for r, s in zip(rows, held[:3], strict=True))


@pytest.mark.parametrize("frames,size", [(9, 48), (5, 32), (9, 64)])
def test_render_moves_each_object_its_way(frames, size):
    """Every object stays in the frame; each colour's pixel centroid moves along its direction by the rendered
    travel (0.30..0.45 of the frame) with little sideways drift; the colour's area stays constant."""
    rng = random.Random(frames * size)
    specs = [s for s in all_specs() if len(s.groups) == 2 or s.groups[0].count == 1]
    for spec in rng.sample(specs, 40):
        clip = render(spec, frames, size, rng)
        assert clip.shape == (frames, size, size, 3) and clip.dtype == np.uint8
        border = np.concatenate([clip[:, 0], clip[:, -1], clip[:, :, 0], clip[:, :, -1]], axis=1)
        assert (border == 255).all(), spec.text()  # objects never touch the edge
        for g in spec.groups:
            masks = np.stack([colour_mask(f, g.color) for f in clip])
            areas = masks.sum((1, 2))
            assert areas.min() > 0.5 * areas.max(), (spec.text(), areas)
            ys, xs = np.mgrid[:size, :size]
            cx = (masks * xs).sum((1, 2)) / areas
            cy = (masks * ys).sum((1, 2)) / areas
            d = np.array([cx[-1] - cx[0], cy[-1] - cy[0]]) / size
            u = np.array(DIRECTIONS[g.direction])
            along, sideways = d @ u, abs(d[0] * u[1] - d[1] * u[0])
            assert TRAVEL[0] - 0.05 < along < TRAVEL[1] + 0.05 and sideways < 0.05, (spec.text(), d)


def test_render_draws_the_asked_count_without_overlap():
    """Two objects of one colour are two separate blobs in every frame (8-connected components of the mask)."""
    from scipy import ndimage

    rng = random.Random(0)
    for spec in [s for s in all_specs() if s.groups[0].count == 2][:24]:
        clip = render(spec, 9, 48, rng)
        for f in clip:
            _, n = ndimage.label(colour_mask(f, spec.groups[0].color), structure=np.ones((3, 3)))
            assert n == 2, spec.text()
    r = RADIUS * 48
    assert r > 5  # objects of about 6 px radius at the toy model's 48 px


def test_render_is_seeded():
    spec = parse_prompt("a red circle moving left and a blue triangle moving up")
    a, b = render(spec, 9, 48, random.Random(7)), render(spec, 9, 48, random.Random(7))
    assert (a == b).all() and not (a == render(spec, 9, 48, random.Random(8))).all()
