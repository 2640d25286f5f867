"""The `motion` reward (polyrl/rewards/motion.py) on hand-drawn clips (drawn here with PIL, not with the task's
renderer), with the expected scores worked out from the formula in its docstring: per group
0.4·motion + 0.2·(colour + shape + count), averaged over groups."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter

from polyrl.config import ConfigError, load_config
from polyrl.rewards import REWARDS, build_reward, call_reward
from polyrl.rewards.motion import MotionReward, clip_displacement, motion_score
from polyrl.toy.motion_task import COLORS, all_specs, render

SIZE, FRAMES = 48, 9


def clip(objects, frames: int = FRAMES, size: int = SIZE, blur: float = 0.0, skip: dict | None = None) -> torch.Tensor:
    """(T, 3, H, W) in [0, 1]. `objects`: (colour, shape, x0, y0, dx, dy, r): centre (x0 + t·dx, y0 + t·dy) at
    frame t, square half-side r, triangle apex up. `skip`: {object index: frames where it is not drawn}."""
    out = []
    for t in range(frames):
        img = Image.new("RGB", (size, size), (255, 255, 255))
        d = ImageDraw.Draw(img)
        for k, (color, shape, x0, y0, dx, dy, r) in enumerate(objects):
            if skip and t in skip.get(k, ()):
                continue
            cx, cy, fill = x0 + t * dx, y0 + t * dy, COLORS[color]
            if shape == "circle":
                d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
            elif shape == "square":
                d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
            else:
                d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        if blur:
            img = img.filter(ImageFilter.GaussianBlur(blur))
        out.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255)
    return torch.stack(out)


def score(reward, video, prompt, meta=None):
    out = reward(video[None], [prompt], [meta or {}])
    return out.scores[0].item(), {k: v[0] for k, v in out.extras.items()}


@pytest.fixture(scope="module")
def reward():
    return MotionReward()


RED_CIRCLE_LEFT = ("red", "circle", 38, 24, -3, 0, 6)  # 24 px = 0.5 of the frame to the left


# ------------------------------------------------------------------------------------------------ contract
def test_registered_reads_video_and_builds():
    assert REWARDS["motion"] is MotionReward and MotionReward.media == ("video",)
    r = build_reward({"name": "motion", "min_travel": 0.2, "motion_weight": 0.5})
    assert r.min_travel == 0.2 and r.motion_weight == 0.5
    with pytest.raises(ValueError, match="motion_weight"):
        MotionReward(motion_weight=1.5)
    with pytest.raises(ValueError, match="square_fill"):
        MotionReward(square_fill=0.0)


def test_call_reward_hands_it_the_video_and_refuses_images(reward):
    video = torch.stack([clip([RED_CIRCLE_LEFT]), clip([])])
    out = call_reward(reward, video, ["a red circle moving left"] * 2, [{}, {}])
    assert out.scores.tolist() == pytest.approx([1.0, 0.0]) and out.scores.dtype == torch.float32
    assert set(out.extras) == {"motion/colour_acc", "motion/shape_acc", "motion/count_acc", "motion/direction_acc",
                               "motion/travel"} and all(len(v) == 2 for v in out.extras.values())
    with pytest.raises(ValueError, match="cannot score images"):
        call_reward(reward, video[:, 0], ["a red circle moving left"] * 2, [{}, {}])


def test_frame_sampling_is_a_config_error():
    with pytest.raises(ConfigError, match="reads video itself"):
        load_config(["recipe=toy_motion", "reward.frames=2"])


def test_bad_prompt_names_it(reward):
    with pytest.raises(ValueError, match="a red circle rolling"):
        reward(clip([])[None], ["a red circle rolling"], [{}])


# ------------------------------------------------------------------------------------------------ scores
def test_correct_clip_scores_one(reward):
    s, ex = score(reward, clip([RED_CIRCLE_LEFT]), "a red circle moving left")
    assert s == pytest.approx(1.0)
    assert ex["motion/travel"] == pytest.approx(0.5, abs=0.02)  # 24 px of 48, measured from the centroids


def test_metadata_takes_precedence_over_the_text(reward):
    meta = {"groups": [{"color": "red", "shape": "circle", "count": 1, "direction": "left"}]}
    assert score(reward, clip([RED_CIRCLE_LEFT]), "any caption", meta)[0] == pytest.approx(1.0)


@pytest.mark.parametrize("objects,expected,why", [
    ([("red", "circle", 10, 24, 3, 0, 6)], 0.6, "opposite direction: motion 0"),
    ([("red", "circle", 24, 38, 0, -3, 6)], 0.6, "perpendicular (up): motion 0"),
    ([("red", "circle", 38, 38, -3, -3, 6)], 0.6, "diagonal: sideways as large as along"),
    ([("red", "circle", 24, 24, 0, 0, 6)], 0.6, "static: motion 0"),
    ([("red", "circle", 28, 24, -0.5, 0, 6)], 0.6 + 0.4 * 4 / 7.2, "4 px of the 7.2 that earn the term"),
    ([("blue", "circle", 38, 24, -3, 0, 6)], 0.0, "wrong colour: nothing of the asked colour"),
    ([("red", "square", 38, 24, -3, 0, 6)], 0.6, "wrong shape: colour and motion only"),
    ([RED_CIRCLE_LEFT, ("red", "circle", 38, 8, -3, 0, 5)], 0.8, "one object too many: count 0"),
    ([], 0.0, "blank"),
])
def test_wrong_clips_score_lower(reward, objects, expected, why):
    s, _ = score(reward, clip(objects), "a red circle moving left")
    assert s == pytest.approx(expected, abs=1e-6), why


def test_count_and_two_groups(reward):
    two = [("blue", "square", 38, 12, 0, -1, 5), ("blue", "square", 14, 36, 0, -1, 5)]  # both up by 8 px
    assert score(reward, clip(two), "two blue squares moving up")[0] == pytest.approx(1.0)
    assert score(reward, clip(two[:1]), "two blue squares moving up")[0] == pytest.approx(0.8)  # too few
    assert score(reward, clip(two), "a blue square moving up")[0] == pytest.approx(0.8)  # too many
    pair = [("green", "triangle", 8, 14, 3, 0, 6), ("yellow", "circle", 36, 8, 0, 3, 6)]
    prompt = "a green triangle moving right and a yellow circle moving down"
    assert score(reward, clip(pair), prompt)[0] == pytest.approx(1.0)
    wrong = [pair[0], ("yellow", "circle", 36, 34, 0, -3, 6)]  # the circle goes up: (1 + 0.6) / 2
    s, ex = score(reward, clip(wrong), prompt)
    assert s == pytest.approx(0.8) and ex["motion/direction_acc"] == pytest.approx(0.5)


def test_frame_fractions_and_tracking_through_a_gap(reward):
    # the circle is missing in frame 4: colour, shape, count 8/9 each; the links around the gap are lost, the rest
    # still measure 3 px/frame: 0.4 + 0.6 * 8/9
    s, ex = score(reward, clip([RED_CIRCLE_LEFT], skip={0: (4,)}), "a red circle moving left")
    assert s == pytest.approx(0.4 + 0.6 * 8 / 9) and ex["motion/travel"] == pytest.approx(0.5, abs=0.02)
    # a second red circle appearing midway does not make the first one's track jump: motion stays 1
    extra = ("red", "circle", 20, 40, -1, 0, 5)
    s, ex = score(reward, clip([RED_CIRCLE_LEFT, extra], skip={1: range(5)}), "a red circle moving left")
    assert ex["motion/direction_acc"] == 1.0 and ex["motion/count_acc"] == pytest.approx(5 / 9)


def test_blurred_correct_clips_still_score_high(reward):
    for blur in (0.7, 1.0):
        assert score(reward, clip([RED_CIRCLE_LEFT], blur=blur), "a red circle moving left")[0] >= 0.9
        pair = [("green", "triangle", 8, 14, 3, 0, 6), ("yellow", "square", 36, 8, 0, 3, 6)]
        assert score(reward, clip(pair, blur=blur), "a green triangle moving right and a yellow square moving down")[0] >= 0.9


def test_rendered_clips_of_the_grammar_score_high(reward):
    """The task's own renderer at the toy model's 48 px, crisp and blurred (as generated clips are soft)."""
    rng = random.Random(0)
    specs = rng.sample(all_specs(), 120)
    for blur in (0.0, 0.7):
        videos = []
        for spec in specs:
            frames = [Image.fromarray(f) for f in render(spec, FRAMES, SIZE, rng)]
            if blur:
                frames = [f.filter(ImageFilter.GaussianBlur(blur)) for f in frames]
            videos.append(torch.from_numpy(np.stack([np.array(f) for f in frames])).permute(0, 3, 1, 2) / 255)
        scores = reward(torch.stack(videos).float(), [s.text() for s in specs]).scores
        assert scores.min().item() >= 0.9, (blur, [s.text() for s, v in zip(specs, scores, strict=True) if v < 0.9])


# ------------------------------------------------------------------------------------------------ pure parts
def test_displacement_and_motion_score_by_hand():
    # two objects moving right by 2 px/frame over 4 frames; a far-away speck in frame 2 links to nothing
    track = [np.array([[10.0, 10.0], [30.0, 30.0]]) + [2.0 * t, 0.0] for t in range(4)]
    track[2] = np.vstack([track[2], [[47.0, 0.0]]])
    assert clip_displacement(track, max_step=5.0) == pytest.approx([6.0, 0.0])
    assert clip_displacement([np.zeros((0, 2))] * 4, 5.0) is None
    assert clip_displacement([np.array([[0.0, 0.0]]), np.array([[20.0, 0.0]])], 5.0) is None  # too far to link
    assert motion_score(np.array([6.0, 0.0]), "right", 4.0) == 1.0
    assert motion_score(np.array([6.0, 1.0]), "right", 10.0) == pytest.approx(0.5)  # (6 - 1) / 10
    assert motion_score(np.array([6.0, 0.0]), "left", 4.0) == 0.0
    assert motion_score(np.array([0.0, -6.0]), "up", 4.0) == 1.0  # image y grows downward
    assert motion_score(None, "up", 4.0) == 0.0
