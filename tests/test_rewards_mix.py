"""reward=mix: weighted sums against a hand computation, per-component logging, required/optional failures,
config validation; the input convention (images / video / audio / latents) and latent rewards skipping the
VAE decode in a real run on the tiny SD3 pipeline."""

import json
import math

import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.rewards import REWARDS, Audio, RewardOutput, build_reward, call_reward, media_kind, reward_inputs
from polyrl.rewards.heads import load_mlp_head, save_mlp_head
from polyrl.rewards.latent import latent_channel_stats
from polyrl.rewards.mix import MixReward, mix_scores


class _Fixed:
    """A test reward: fixed scores, or an exception, or NaN at given samples."""

    def __init__(self, scores=None, error=None, nan_at=()):
        self.scores, self.error, self.nan_at = scores, error, tuple(nan_at)

    def __call__(self, images, prompts, metadata):
        if self.error:
            raise RuntimeError(self.error)
        s = torch.tensor(self.scores, dtype=torch.float32)
        s[list(self.nan_at)] = float("nan")
        return RewardOutput(s, {"fixed/extra": [1.0] * len(s)})


@pytest.fixture
def fixed_rewards(monkeypatch):
    """Register `_a`, `_b` test rewards for the duration of one test."""
    monkeypatch.setitem(REWARDS, "_a", _Fixed)
    monkeypatch.setitem(REWARDS, "_b", _Fixed)


IMGS = torch.zeros(3, 3, 4, 4)
PROMPTS = ["p"] * 3


def test_weighted_sum_and_component_logging(fixed_rewards):
    mix = MixReward({"_a": {"weight": 0.7, "scores": [1.0, 0.0, 0.5]}, "_b": {"weight": 0.3, "scores": [0.0, 1.0, 2.0]}})
    out = mix(IMGS, PROMPTS, [{}] * 3)
    assert out.scores.tolist() == pytest.approx([0.7, 0.3, 0.35 + 0.6])
    assert out.extras["reward/_a"] == [1.0, 0.0, 0.5] and out.extras["reward/_b"] == [0.0, 1.0, 2.0]
    assert out.extras["reward/_a/failed"] == [0.0, 0.0, 0.0]
    # both components report the same extra key: the second is prefixed by its label, nothing is lost
    assert "fixed/extra" in out.extras and "_b/fixed/extra" in out.extras


def test_required_failure_names_the_component(fixed_rewards):
    mix = MixReward({"_a": {"weight": 1.0, "scores": [1.0] * 3}, "_b": {"weight": 1.0, "error": "server down"}})
    with pytest.raises(RuntimeError, match=r"reward\.mix component '_b' \(required\) failed: RuntimeError: server down"):
        mix(IMGS, PROMPTS, [{}] * 3)
    mix = MixReward({"_a": {"weight": 1.0, "scores": [1.0] * 3, "nan_at": [1]}, "_b": {"weight": 1.0, "scores": [0.0] * 3}})
    with pytest.raises(RuntimeError, match=r"component '_a' \(required\) returned 1 non-finite scores of 3"):
        mix(IMGS, PROMPTS, [{}] * 3)


def test_optional_failure_is_excluded_and_counted(fixed_rewards):
    mix = MixReward({"_a": {"weight": 0.75, "scores": [1.0, 2.0, 3.0]},
                     "_b": {"weight": 0.25, "error": "timeout", "required": False}})
    out = mix(IMGS, PROMPTS, [{}] * 3)
    # renormalised: the total weight 1.0 is carried by _a alone
    assert out.scores.tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert out.extras["reward/_b/failed"] == [1.0, 1.0, 1.0]
    assert all(math.isnan(x) for x in out.extras["reward/_b"])
    assert "timeout" in mix.last_errors["_b"]


def test_per_sample_exclusion(fixed_rewards):
    mix = MixReward({"_a": {"weight": 2.0, "scores": [1.0, 1.0, 1.0]},
                     "_b": {"weight": -1.0, "scores": [4.0, 4.0, 4.0], "nan_at": [2], "required": False}})
    out = mix(IMGS, PROMPTS, [{}] * 3)
    # rows 0, 1: 2*1 - 1*4 = -2; row 2: only _a, scaled by (|2|+|-1|)/|2|: 2 * 1.5 = 3
    assert out.scores.tolist() == pytest.approx([-2.0, -2.0, 3.0])
    assert out.extras["reward/_b/failed"] == [0.0, 0.0, 1.0]


def test_a_sample_nobody_scored_is_an_error_not_zero(fixed_rewards):
    mix = MixReward({"_a": {"weight": 1.0, "error": "x", "required": False},
                     "_b": {"weight": 1.0, "scores": [1.0] * 3, "nan_at": [0], "required": False}})
    with pytest.raises(RuntimeError, match=r"no component scored 1 of 3 samples \(first: sample 0\)"):
        mix(IMGS, PROMPTS, [{}] * 3)


def test_mix_scores_against_a_loop():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(50, 4, generator=g, dtype=torch.float64)
    s[torch.rand(50, 4, generator=g) < 0.3] = float("nan")
    w = torch.tensor([0.5, -0.2, 1.0, 0.3], dtype=torch.float64)
    got = mix_scores(s, w)
    for i in range(50):
        ok = [k for k in range(4) if not math.isnan(s[i, k].item())]
        if not ok:
            assert math.isnan(got[i].item())
            continue
        total = sum(w[k].item() * s[i, k].item() for k in ok)
        expect = total * sum(abs(x) for x in w.tolist()) / sum(abs(w[k].item()) for k in ok)
        assert got[i].item() == pytest.approx(expect, abs=1e-12)


def test_same_scorer_twice_with_labels():
    mix = build_reward({"name": "mix", "mix": {"small": {"reward": "jpeg_compressibility", "weight": 1.0, "quality": 10},
                                               "large": {"reward": "jpeg_compressibility", "weight": 1.0, "quality": 95}}})
    imgs = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    out = mix(imgs, ["a", "b"], [{}, {}])
    small, large = (torch.tensor(out.extras[f"reward/{k}"], dtype=torch.float64) for k in ("small", "large"))
    assert (small > large).all()  # lower quality: fewer kB: higher compressibility score
    assert torch.allclose(out.scores.double(), small + large, atol=1e-5)


def test_config_accepts_mix_and_validates_components():
    cfg = load_config(["reward=mix", "reward.mix={shapes: 0.7, jpeg_compressibility: {weight: 0.3, required: false, quality: 80}}"])
    assert cfg.reward.mix.jpeg_compressibility.quality == 80
    with pytest.raises(ConfigError, match=r"reward\.mix must be set"):
        load_config(["reward=mix"])
    with pytest.raises(ConfigError, match=r"reward\.mix\.nope: reward 'nope' is not registered \(the label is"):
        load_config(["reward=mix", "reward.mix={shapes: 0.7, nope: 1}"])
    with pytest.raises(ConfigError, match=r"unknown key reward\.mix\.shapes\.bogus .*allowed: color_threshold"):
        load_config(["reward=mix", "reward.mix={shapes: {weight: 1, bogus: 2}}"])
    with pytest.raises(ConfigError, match=r"reward\.mix\.shapes\.weight must be set"):
        load_config(["reward=mix", "reward.mix={shapes: {required: false}}"])
    with pytest.raises(ConfigError, match=r"reward\.mix\.mean: the label may not be mean or std"):
        load_config(["reward=mix", "reward.mix={mean: {reward: shapes, weight: 1}}"])
    with pytest.raises(ConfigError, match=r"reward\.mix\.shapes\.required='yes' must be true or false"):
        load_config(["reward=mix", "reward.mix={shapes: {weight: 1, required: 'yes'}}"])
    with pytest.raises(ConfigError, match=r"unknown key reward\.mix\.ocr; .*\+reward\.mix\.<reward>=<weight>"):
        load_config(["reward=mix", "reward.mix.ocr=0.5"])  # Hydra needs + to add a key
    assert load_config(["reward=mix", "+reward.mix.ocr=0.5"]).reward.mix.ocr == 0.5


# ----------------------------------------------------------------------------------------- media kinds
class _FrameMean:
    """A frame-wise video reward: the mean brightness of every frame, averaged over frames."""

    media = ("video",)  # reads video itself (an image scorer would get sampled frames)

    def __call__(self, video, prompts, metadata):
        assert media_kind(video) == "video"
        return RewardOutput(video.mean(dim=(2, 3, 4)).mean(1), {"video/frames": [video.shape[1]] * len(video)})


class _Loudness:
    """An audio reward: RMS of the waveform in decibels; checks that the sample rate travels with it."""

    media = ("audio",)

    def __call__(self, audio, prompts, metadata):
        assert media_kind(audio) == "audio" and audio.sample_rate == 16000
        rms = audio.waveform.pow(2).mean(dim=(1, 2)).sqrt()
        return RewardOutput(20 * torch.log10(rms), {"audio/seconds": [audio.waveform.shape[-1] / audio.sample_rate] * len(audio)})


def test_video_and_audio_through_the_mix(monkeypatch):
    monkeypatch.setitem(REWARDS, "_frames", _FrameMean)
    monkeypatch.setitem(REWARDS, "_loud", _Loudness)
    video = torch.stack([torch.full((5, 3, 8, 8), v) for v in (0.25, 0.75)])  # (B=2, T=5, 3, 8, 8)
    out = build_reward({"name": "mix", "mix": {"_frames": 2.0}})(video, ["a", "b"], [{}, {}])
    assert out.scores.tolist() == pytest.approx([0.5, 1.5]) and out.extras["video/frames"] == [5, 5]

    t = torch.arange(16000) / 16000
    wave = torch.stack([0.5 * torch.sin(2 * math.pi * 440 * t), 0.05 * torch.sin(2 * math.pi * 440 * t)])[:, None]
    out = build_reward({"name": "mix", "mix": {"_loud": 1.0}})(Audio(wave, 16000), ["a", "b"], [{}, {}])
    # RMS of a sine of amplitude A is A / sqrt(2)
    assert out.scores.tolist() == pytest.approx([20 * math.log10(0.5 / math.sqrt(2)), 20 * math.log10(0.05 / math.sqrt(2))], abs=1e-3)
    assert out.extras["audio/seconds"] == [1.0, 1.0]


def test_media_kind_errors():
    assert media_kind(torch.zeros(2, 3, 4, 4)) == "images"
    assert media_kind(torch.zeros(2, 7, 3, 4, 4)) == "video"
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\), video .* got \(2, 4, 4\)"):
        media_kind(torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match=r"Audio.waveform must be \(B, channels, samples\)"):
        Audio(torch.zeros(2, 100), 16000)


# ----------------------------------------------------------------------------------------- latent rewards
def _latent_head(tmp_path, channels=4, seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Sequential(torch.nn.Linear(2 * channels, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return head, save_mlp_head(head, tmp_path / "latent_head.safetensors")


def test_latent_predictor_matches_a_float64_reference(tmp_path):
    head, path = _latent_head(tmp_path)
    reward = build_reward({"name": "latent_predictor", "path": str(path)})
    assert reward_inputs(reward) == {"latents"}
    lat = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(1))
    out = call_reward(reward, None, ["a"] * 3, [{}] * 3, latents=lat)
    # reference: features by explicit loops in float64, the head's weights applied by hand
    x = lat.double()
    feats = torch.tensor([[x[b, c].mean().item() for c in range(4)] +
                          [math.sqrt(((x[b, c] - x[b, c].mean()) ** 2).mean().item()) for c in range(4)] for b in range(3)],
                         dtype=torch.float64)
    w0, b0, w1, b1 = (p.detach().double() for p in (head[0].weight, head[0].bias, head[2].weight, head[2].bias))
    ref = (torch.relu(feats @ w0.T + b0) @ w1.T + b1).reshape(-1)
    assert torch.allclose(out.scores.double(), ref, atol=1e-5)
    assert torch.allclose(latent_channel_stats(lat).double(), feats, atol=1e-5)


def test_mlp_head_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="MLP head file .*nope.safetensors' not found"):
        load_mlp_head(tmp_path / "nope.safetensors")
    _, path = _latent_head(tmp_path)
    with pytest.raises(ValueError, match=r"no 'rm_head\.<i>\.weight' tensors"):
        load_mlp_head(path, prefix="rm_head.")
    reward = build_reward({"name": "latent_predictor", "path": str(path)})
    with pytest.raises(ValueError, match=r"expects 8 features \(2 x channels\), the latents have 16 channels"):
        reward(None, ["a"], [{}], latents=torch.zeros(1, 16, 2, 2))


def test_mix_of_image_and_latent_rewards_gets_both(tmp_path):
    _, path = _latent_head(tmp_path)
    mix = build_reward({"name": "mix", "mix": {"latent_predictor": {"weight": 1.0, "path": str(path)},
                                               "jpeg_compressibility": 1.0}})
    assert reward_inputs(mix) == {"images", "latents"}
    lat, imgs = torch.randn(2, 4, 3, 3), torch.rand(2, 3, 16, 16)
    out = call_reward(mix, imgs, ["a", "b"], [{}, {}], latents=lat)
    assert torch.allclose(out.scores.double(), torch.tensor(out.extras["reward/latent_predictor"], dtype=torch.float64) +
                          torch.tensor(out.extras["reward/jpeg_compressibility"], dtype=torch.float64), atol=1e-4)
    only_latent = build_reward({"name": "mix", "mix": {"latent_predictor": {"weight": 1.0, "path": str(path)}}})
    assert reward_inputs(only_latent) == {"latents"}


def _train(model_dir, prompts, out, mix, steps=2):
    from polyrl.cli.main import main

    args = ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2",
            "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]", "data.prompts_per_step=2",
            "rollout.batch_size=4", "model.max_sequence_length=16", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "trainer.tensorboard=false", "reward=mix", f"reward.mix={mix}"]
    assert main(args) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_optional_ocr_failing_in_a_run_is_counted(tiny_sd3_dir, shape_prompts_file, tmp_path):
    """The shape prompts have no quoted text: an optional OCR component fails on every sample, is counted,
    and the reward is the renormalised JPEG component; marked required, the same run stops naming it."""
    rows = _train(tiny_sd3_dir, shape_prompts_file, tmp_path / "opt",
                  "{ocr: {weight: 0.5, required: false}, jpeg_compressibility: 0.5}", steps=1)
    assert rows[0]["reward/ocr/failed"] == 1.0 and rows[0]["reward/jpeg_compressibility/failed"] == 0.0
    assert "reward/ocr" not in rows[0]  # no finite OCR score to average
    assert rows[0]["reward/mean"] == pytest.approx(rows[0]["reward/jpeg_compressibility"], rel=1e-5)
    with pytest.raises(RuntimeError, match=r"reward\.mix component 'ocr' \(required\) failed: ValueError: ocr "
                                           r"reward: prompt .* has no quoted target text"):
        _train(tiny_sd3_dir, shape_prompts_file, tmp_path / "req", "{ocr: 0.5, jpeg_compressibility: 0.5}", steps=1)


def test_latent_reward_run_never_decodes(tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch):
    """A 2-step CLI run with a latent-only mix: the adapter's decode is never called, metrics carry the
    component; the same run with an image reward in the mix does decode."""
    from polyrl.models.sd3 import SD3Policy

    calls = []
    original = SD3Policy.decode
    monkeypatch.setattr(SD3Policy, "decode", lambda self, latents: calls.append(latents["x"].shape[0]) or original(self, latents))
    _, head = _latent_head(tmp_path)

    def run(out, mix):
        return _train(tiny_sd3_dir, shape_prompts_file, out, mix)

    rows = run(tmp_path / "latent", f"{{latent_predictor: {{weight: 1.0, path: '{head}'}}}}")
    assert calls == []
    assert len(rows) == 2 and all("reward/latent_predictor" in r and "time/decode" not in r for r in rows)
    assert rows[0]["reward/mean"] == pytest.approx(rows[0]["reward/latent_predictor"], abs=1e-6)

    rows = run(tmp_path / "both", f"{{latent_predictor: {{weight: 1.0, path: '{head}'}}, jpeg_compressibility: 0.5}}")
    assert sum(calls) == 2 * 4  # every training sample decoded once per step
    assert all("time/decode" in r and "reward/jpeg_compressibility" in r for r in rows)
