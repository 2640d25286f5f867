"""`temporal_consistency` (polyrl/rewards/temporal_consistency.py): a static clip scores higher than a flickering
one, in pixel space and through a tiny random image encoder built here."""

from __future__ import annotations

import pytest
import torch

from polyrl.rewards import REWARDS, build_reward, call_reward
from polyrl.rewards.temporal_consistency import TemporalConsistency

T, S = 6, 32


def static_clip() -> torch.Tensor:
    frame = torch.zeros(3, S, S)
    frame[0, 8:20, 8:20] = 1.0
    return frame.expand(T, 3, S, S).clone()


def flicker_clip() -> torch.Tensor:
    clip = static_clip()
    clip[1::2] = 1.0 - clip[1::2]  # every other frame inverted
    return clip


def test_pixel_form_formula_and_order():
    r = build_reward({"name": "temporal_consistency"})
    assert REWARDS["temporal_consistency"] is TemporalConsistency and r.encoder is None
    video = torch.stack([static_clip(), flicker_clip()])
    out = call_reward(r, video, ["a", "b"], [{}, {}])
    assert out.scores[0].item() == pytest.approx(1.0)
    assert out.scores[1].item() == pytest.approx(0.0, abs=1e-6)  # each pair differs by exactly 1 everywhere
    half = static_clip()
    half[3:] *= 0.5  # one pair changes: 12*12 px of one channel by 0.5
    expected = 1.0 - (0.5 * 144 / (3 * S * S)) / (T - 1)
    assert r(half[None], ["c"]).scores[0].item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="cannot score images"):
        call_reward(r, video[:, 0], ["a", "b"], [{}, {}])


def test_missing_encoder_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local model directory"):
        TemporalConsistency(path=str(tmp_path / "nope"))


def test_tiny_random_encoder(tmp_path):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, projection_dim=16)
    CLIPVisionModel(cfg).save_pretrained(tmp_path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    r = build_reward({"name": "temporal_consistency", "path": str(tmp_path), "device": "cpu"})
    out = r(torch.stack([static_clip(), flicker_clip()]), ["a", "b"])
    static, flicker = out.scores.tolist()
    assert static == pytest.approx(1.0, abs=1e-5) and flicker < static - 1e-3
    assert out.extras["temporal/min_pair"][0] == pytest.approx(1.0, abs=1e-5)
