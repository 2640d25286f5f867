"""`reward=clap` on a tiny random ClapModel the test builds and saves: the score equals the cosine similarity computed
independently from the model's own get_text_features / get_audio_features, long clips are the mean over their
windows, stereo is mixed down, other rates are resampled, and a non-audio batch is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.media import Audio
from polyrl.rewards import build_reward, call_reward
from polyrl.rewards.clap import audio_windows, resample

RATE, WINDOW_S = 8000, 1  # the tiny extractor: 8 kHz, 1 s windows (51 frames of hop 160 fit the 64-frame swin input)
WORDS = "a dog barks loudly in the rain soft piano melody birds sing at dawn".split()
PROMPTS = ["a dog barks loudly", "soft piano melody", "birds sing at dawn"]


def build_tiny_clap(path, seed: int = 0):
    """A ClapModel (text: 1-layer RoBERTa-style, audio: 2-stage HTSAT with 16 mel bins), a word-level tokenizer and a
    ClapFeatureExtractor at 8 kHz with 1 s windows, saved to `path`."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    from polyrl.models.tiny import word_tokenizer

    tokenizer = word_tokenizer(WORDS, 16, add_bos=True)
    torch.manual_seed(seed)
    config = ClapConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=40, projection_dim=8, pad_token_id=0),
        audio_config=dict(window_size=4, num_mel_bins=16, spec_size=32, patch_size=4, patch_stride=(4, 4),
                          depths=[1, 1], num_attention_heads=[1, 1], patch_embeds_hidden_size=8, hidden_size=16,
                          projection_dim=8, enable_fusion=False),
        projection_dim=8)
    model = ClapModel(config).eval()
    features = ClapFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=160, max_length_s=WINDOW_S,
                                    fft_window_size=256, truncation="rand_trunc")
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    features.save_pretrained(str(path))
    return model, tokenizer, features


@pytest.fixture(scope="module")
def clap(tmp_path_factory):
    path = tmp_path_factory.mktemp("clap")
    model, tokenizer, features = build_tiny_clap(path)
    reward = build_reward({"name": "clap", "path": str(path), "device": "cpu"})
    return reward, model, tokenizer, features


def expected_cosine(model, tokenizer, features, clip: np.ndarray, prompt: str) -> float:
    """cos(a, t) = a·t / (‖a‖‖t‖) in float64 from the model's own feature methods (no normalisation of ours)."""
    with torch.no_grad():
        feats = features([clip], sampling_rate=RATE, truncation="rand_trunc", return_tensors="pt")
        a = model.get_audio_features(input_features=feats["input_features"]).pooler_output[0].double()
        ids = tokenizer([prompt], padding=True, return_tensors="pt")
        t = model.get_text_features(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).pooler_output[0]
    t = t.double()
    return float(a @ t / (a.norm() * t.norm()))


def _clips(n: int, samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / RATE
    return np.stack([0.3 * np.sin(2 * np.pi * (200 + 150 * i) * t) + 0.05 * rng.standard_normal(samples)
                     for i in range(n)]).astype(np.float32)


def test_score_equals_the_models_own_cosine_similarity(clap):
    reward, model, tokenizer, features = clap
    clips = _clips(3, int(0.6 * RATE))  # shorter than a window: repeat-padded, one window each
    out = call_reward(reward, Audio(torch.from_numpy(clips)[:, None], RATE), PROMPTS, [{}] * 3)
    expected = [expected_cosine(model, tokenizer, features, c, p) for c, p in zip(clips, PROMPTS, strict=True)]
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32
    torch.testing.assert_close(out.scores.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert len(set(np.round(expected, 6))) == 3  # the prompts and clips really differ
    again = reward(Audio(torch.from_numpy(clips)[:, None], RATE), PROMPTS)  # deterministic (no random crop)
    assert torch.equal(out.scores, again.scores)
    assert out.extras["clap_windows"] == [1.0, 1.0, 1.0]


def test_long_clips_are_the_mean_over_windows_and_stereo_is_mixed_down(clap):
    reward, model, tokenizer, features = clap
    window = RATE * WINDOW_S
    left, right = _clips(2, int(2.7 * window), seed=1)
    stereo = torch.from_numpy(np.stack([left, right]))[None]  # (1, 2, 2.7 windows)
    mono = (left.astype(np.float64) + right) / 2
    # 2.7 windows: two whole windows and a final 0.7 (kept: at least half a window)
    parts = [mono[:window], mono[window : 2 * window], mono[2 * window :]]
    expected = np.mean([expected_cosine(model, tokenizer, features, p, PROMPTS[0]) for p in parts])
    out = reward(Audio(stereo, RATE), PROMPTS[:1])
    assert out.extras["clap_windows"] == [3.0]
    assert float(out.scores[0]) == pytest.approx(expected, abs=1e-6)
    # 2.3 windows: the final 0.3 is left out
    short = reward(Audio(stereo[..., : int(2.3 * window)], RATE), PROMPTS[:1])
    expected2 = np.mean([expected_cosine(model, tokenizer, features, p, PROMPTS[0]) for p in parts[:2]])
    assert short.extras["clap_windows"] == [2.0] and float(short.scores[0]) == pytest.approx(expected2, abs=1e-6)


def test_other_sample_rates_are_resampled(clap):
    reward, model, tokenizer, features = clap
    t16 = np.arange(int(0.5 * 2 * RATE)) / (2 * RATE)
    clip16 = 0.4 * np.sin(2 * np.pi * 440 * t16)  # 440 Hz at 16 kHz
    out = reward(Audio(torch.from_numpy(clip16).float()[None, None], 2 * RATE), PROMPTS[1:2])
    t8 = np.arange(int(0.5 * RATE)) / RATE
    resampled = resample(clip16, 2 * RATE, RATE)
    assert resampled.shape == t8.shape
    interior = slice(50, -50)  # polyphase filtering's edges aside, the same sine at 8 kHz
    assert np.abs(resampled[interior] - 0.4 * np.sin(2 * np.pi * 440 * t8)[interior]).max() < 1e-2
    expected = expected_cosine(model, tokenizer, features, resampled.astype(np.float32), PROMPTS[1])
    assert float(out.scores[0]) == pytest.approx(expected, abs=1e-5)


def test_windows_rule():
    assert [len(p) for p in audio_windows(np.zeros(25), 10)] == [10, 10, 5]  # half a window: kept
    assert [len(p) for p in audio_windows(np.zeros(24), 10)] == [10, 10]
    assert [len(p) for p in audio_windows(np.zeros(3), 10)] == [3]  # shorter than a window: kept
    assert math.gcd(44100, 48000) == 300  # resample's up/down factors (160/147) come from this


def test_refuses_images_and_missing_checkpoints(clap, tmp_path):
    reward, *_ = clap
    with pytest.raises(ValueError, match="reward clap reads audio; it cannot score images"):
        call_reward(reward, torch.rand(2, 3, 8, 8), PROMPTS[:2], [{}, {}])
    with pytest.raises(FileNotFoundError, match="reward.path \\(a CLAP model\\).*not a local model directory"):
        build_reward({"name": "clap", "path": str(tmp_path / "missing")})
