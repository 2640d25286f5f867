"""vlm_judge on video (polyrl/rewards/vlm_judge.py): a clip is judged once from `video_frames` evenly spaced
frames shown as the images of one turn, on the tiny scripted LLaVA of tests/test_rewards_vlm.py."""

import pytest
import torch
from test_rewards_vlm import SCRIPT, build_tiny_llava

from polyrl.rewards import build_reward, call_reward
from polyrl.rewards.vlm_judge import DEFAULT_VIDEO_TEMPLATE, VLMJudge


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("judge"), script=SCRIPT)


def _video(b=2, t=7):
    return torch.rand(b, t, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def test_video_is_judged_once_from_sampled_frames(judge_dir, monkeypatch):
    judge = build_reward({"name": "vlm_judge", "path": str(judge_dir), "template": "rate the image {prompt} answer",
                          "score_range": [0, 10], "video_frames": 3, "device": "cpu"})
    seen = []
    original = type(judge.vlm).generate

    def spy(self, pictures, questions, max_new_tokens):
        seen.append((pictures, list(questions)))
        return original(self, pictures, questions, max_new_tokens)

    monkeypatch.setattr(type(judge.vlm), "generate", spy)
    video = _video()
    out = call_reward(judge, video, ["a red circle", "a blue square"], [{}, {}])  # no per-frame split by call_reward
    assert out.scores.tolist() == pytest.approx([0.8, 0.8]) and judge.last_answers == ["score : 8"] * 2
    (pictures, questions), = seen  # one call, one turn per clip of its 3 frames
    expected = video[:, [0, 3, 6]].mul(255).round().to(torch.uint8).permute(0, 1, 3, 4, 2)  # round(linspace(0, 6, 3))
    assert [len(p) for p in pictures] == [3, 3]
    assert all(torch.equal(torch.from_numpy(f), expected[i, j]) for i in range(2) for j, f in enumerate(pictures[i]))
    assert questions == ["rate the image a red circle answer", "rate the image a blue square answer"]


def test_each_frame_is_an_image_of_the_turn(judge_dir):
    judge = VLMJudge(str(judge_dir), video_frames=4, device="cpu")
    image_id = judge.vlm.processor.tokenizer.convert_tokens_to_ids("<image>")
    one = judge.vlm.inputs(_video(1, 1)[:, 0], ["q"])
    four = judge.vlm.inputs(judge.sample_frames(_video(1, 9)), ["q"])
    per_image = int((one["input_ids"] == image_id).sum())
    assert per_image > 0 and int((four["input_ids"] == image_id).sum()) == 4 * per_image
    assert four["pixel_values"].shape[0] == 4
    assert judge.video_template == DEFAULT_VIDEO_TEMPLATE
    short = judge.sample_frames(_video(1, 2))  # fewer frames than video_frames: every frame
    assert short.shape[1] == 2


def test_video_frames_config(judge_dir):
    with pytest.raises(ValueError, match=r"video_frames=0 must be an integer >= 1"):
        build_reward({"name": "vlm_judge", "path": str(judge_dir), "video_frames": 0})
    with pytest.raises(ValueError, match=r"reads video itself"):  # `frames` is the image-scorer sampling
        build_reward({"name": "vlm_judge", "path": str(judge_dir), "frames": 4})
