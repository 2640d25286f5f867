"""Every image scorer on video (`reward.frames`, `reward.frame_reduce`), and video / audio through the reward
server and the `http` client: frame sampling against a float64 hand computation, config errors, `mix`
components with their own frames, a 5-frame video and audio through `serve-reward`, limits and contract errors."""

import base64
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.rewards import REWARDS, Audio, RewardOutput, build_reward, call_reward
from polyrl.rewards.base import FrameSampling, frame_indices, media_kind
from polyrl.rewards.codec import (
    decode_audio,
    decode_video,
    encode_audio,
    encode_images,
    encode_mp4,
    encode_videos,
    encode_wav,
    stack_audio,
    stack_videos,
    video_to_uint8,
)
from polyrl.serving.cli import reward_config
from polyrl.serving.server import BackgroundServer, ServerLimits, create_app


def _video(b=2, t=5, h=16, w=16, seed=0):
    """Smooth per-frame content (different JPEG sizes per frame and video)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, t, 3, 1, 1, generator=g) * torch.rand(b, t, 1, h, w, generator=g)).clamp(0, 1)


class _Weighted:
    """An image scorer with a distinct score per image: sum of pixels weighted by position; it records what it
    was given and returns per-image extras (a number, a constant string, a per-image string)."""

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata):
        assert media_kind(images) == "images"
        self.calls.append((images.shape, list(prompts), list(metadata)))
        w = torch.arange(images[0].numel(), dtype=torch.float64).reshape(images.shape[1:]) / images[0].numel()
        s = (images.double() * w).sum(dim=(1, 2, 3))
        return RewardOutput(s.float(), {"x2": (2 * s).tolist(), "const": ["c"] * len(s),
                                        "which": [f"{p}" for p in prompts], "scalar": 7})


# ---------------------------------------------------------------------------------------------- frame sampling
def test_frame_indices_are_evenly_spaced_by_hand():
    assert frame_indices(5, 3) == [0, 2, 4]
    assert frame_indices(6, 4) == [0, 2, 3, 5]  # 0, 1.67, 3.33, 5
    assert frame_indices(4, 3) == [0, 2, 3]  # 0, 1.5 (half to even: 2), 3
    assert frame_indices(10, 1) == [0]
    assert frame_indices(3, 3) == [0, 1, 2] and frame_indices(3, None) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"reward.mix.a.frames=6 is more than the 5 frames of the video"):
        frame_indices(5, 6, "reward.mix.a")


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_frames_wrapper_against_a_float64_hand_computation(reduce):
    video = torch.rand(3, 7, 3, 4, 5, generator=torch.Generator().manual_seed(1))
    reward = _Weighted()
    reward.frame_sampling = FrameSampling(3, reduce)
    prompts, metadata = ["a", "b", "c"], [{"i": 0}, {"i": 1}, {"i": 2}]
    out = call_reward(reward, video, prompts, metadata)
    # the scorer saw 3 frames per video, frames 0, 3, 6 (round(linspace(0, 6, 3))), prompts/metadata repeated
    shape, seen_prompts, seen_meta = reward.calls[0]
    assert shape == (9, 3, 4, 5)
    assert seen_prompts == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert [m["i"] for m in seen_meta] == [0] * 3 + [1] * 3 + [2] * 3
    n = 3 * 4 * 5
    expect, x2 = [], []
    for b in range(3):
        per_frame = []
        for t in (0, 3, 6):
            total = 0.0
            for i, v in enumerate(video[b, t].double().flatten().tolist()):
                total += v * i / n
            per_frame.append(total)
        if reduce == "mean":
            expect.append(sum(per_frame) / 3)
            x2.append(sum(2 * p for p in per_frame) / 3)
        else:
            expect.append(min(per_frame))
            x2.append(2 * min(per_frame))  # the extras of the frame that gave the lowest score
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    assert out.scores.double().tolist() == pytest.approx(expect, rel=1e-6)
    assert out.extras["x2"] == pytest.approx(x2, rel=1e-6)
    assert out.extras["const"] == ["c"] * 3 and out.extras["scalar"] == 7  # per frame, all equal; not per sample
    assert out.extras["which"] == ["a", "b", "c"]  # a string equal over a video's frames is kept


def test_frames_unset_is_every_frame_and_mean():
    video = torch.rand(2, 4, 3, 3, 3, generator=torch.Generator().manual_seed(2))
    reward = _Weighted()
    out = call_reward(reward, video, ["a", "b"], None)
    assert reward.calls[0][0] == (8, 3, 3, 3)
    per_image = reward(video.flatten(0, 1), ["x"] * 8, [{}] * 8).scores.double().view(2, 4)
    assert torch.allclose(out.scores.double(), per_image.mean(1), rtol=1e-6)


def test_nan_per_frame_is_not_hidden_and_varying_strings_become_none():
    class Half:
        def __call__(self, images, prompts, metadata):
            s = torch.ones(len(images))
            s[1] = float("nan")
            return RewardOutput(s, {"tag": [str(i) for i in range(len(images))]})

    out = call_reward(Half(), torch.zeros(2, 2, 3, 2, 2), ["a", "b"], [{}, {}])
    assert math.isnan(out.scores[0]) and out.scores[1] == 1.0
    assert out.extras["tag"] == [None, None]


def test_build_reward_pops_frame_options_and_checks_them():
    r = build_reward({"name": "jpeg_compressibility", "quality": 80, "frames": 3, "frame_reduce": "min", "async": True})
    assert r.quality == 80 and r.frame_sampling == FrameSampling(3, "min", "reward")
    assert not hasattr(build_reward({"name": "jpeg_compressibility"}), "frame_sampling")
    for bad, message in [({"frames": 0}, r"reward.frames=0 must be null \(every frame\) or an integer >= 1"),
                         ({"frames": 2.5}, r"reward.frames=2.5 must be null"),
                         ({"frames": True}, r"reward.frames=True must be null"),
                         ({"frame_reduce": "max"}, r"reward.frame_reduce='max' is not valid; allowed: mean, min")]:
        with pytest.raises(ValueError, match=message):
            build_reward({"name": "jpeg_compressibility", **bad})
    with pytest.raises(ValueError, match=r"reward.frames / reward.frame_reduce: reward http reads video itself"):
        build_reward({"name": "http", "url": "http://x", "frames": 2})
    with pytest.raises(ValueError, match=r"reward mix reads video itself"):
        build_reward({"name": "mix", "mix": {"jpeg_compressibility": 1.0}, "frames": 2})


def test_frames_more_than_the_video_and_audio_for_an_image_scorer_are_errors():
    reward = build_reward({"name": "jpeg_compressibility", "frames": 6})
    with pytest.raises(ValueError, match=r"reward.frames=6 is more than the 5 frames of the video"):
        call_reward(reward, _video(), ["a", "b"], [{}, {}])
    audio = Audio(torch.zeros(2, 1, 100), 16000)
    with pytest.raises(ValueError, match=r"reward jpeg_compressibility reads images; it cannot score audio"):
        call_reward(reward, audio, ["a", "b"], [{}, {}])


def test_a_dict_of_several_kinds_goes_to_what_each_reward_reads():
    video, audio = _video(), Audio(torch.full((2, 1, 40), 0.5), 8000)
    media = {"video": video, "audio": audio}
    image = build_reward({"name": "jpeg_compressibility", "frames": 2})
    assert torch.equal(call_reward(image, media, ["a", "b"], None).scores,
                       call_reward(image, video, ["a", "b"], None).scores)
    loud = _Loudness()
    assert call_reward(loud, media, ["a", "b"], None).scores.tolist() == pytest.approx([20 * math.log10(0.5)] * 2)

    class Both:
        media = ("video", "audio")

        def __call__(self, media, prompts, metadata):
            return RewardOutput(media["video"].mean(dim=(1, 2, 3, 4)) + media["audio"].waveform.mean(dim=(1, 2)))

    assert call_reward(Both(), media, ["a", "b"], None).scores.tolist() == pytest.approx(
        (video.mean(dim=(1, 2, 3, 4)) + 0.5).tolist())
    with pytest.raises(ValueError, match=r"reward _Loudness reads audio; the media are images"):
        call_reward(loud, {"images": video[:, 0]}, ["a", "b"], None)


def test_jpeg_on_video_equals_jpeg_on_its_frames():
    video = _video()
    reward = build_reward({"name": "jpeg_compressibility", "frames": 3})
    out = call_reward(reward, video, ["a", "b"], [{}, {}])
    plain = build_reward({"name": "jpeg_compressibility"})
    frames = plain(video[:, [0, 2, 4]].flatten(0, 1), ["a"] * 6, [{}] * 6)
    assert torch.allclose(out.scores, frames.scores.view(2, 3).mean(1))
    kb = torch.tensor(frames.extras["jpeg/kilobytes"]).view(2, 3).mean(1)
    assert out.extras["jpeg/kilobytes"] == pytest.approx(kb.tolist())


def test_mix_components_take_their_own_frames():
    mix = build_reward({"name": "mix", "mix": {
        "three": {"reward": "jpeg_compressibility", "weight": 1.0, "frames": 3},
        "worst": {"reward": "jpeg_compressibility", "weight": 0.5, "frame_reduce": "min"}}})
    assert set(mix.media) == {"images", "video"}
    video = _video()
    out = mix(video, ["a", "b"], [{}, {}])
    jpeg = build_reward({"name": "jpeg_compressibility"})
    per_frame = jpeg(video.flatten(0, 1), ["a"] * 10, [{}] * 10).scores.double().view(2, 5)
    three, worst = per_frame[:, [0, 2, 4]].mean(1), per_frame.min(1).values
    assert out.extras["reward/three"] == pytest.approx(three.tolist(), rel=1e-6)
    assert out.extras["reward/worst"] == pytest.approx(worst.tolist(), rel=1e-6)
    assert out.scores.double().tolist() == pytest.approx((three + 0.5 * worst).tolist(), rel=1e-5)
    with pytest.raises(ValueError, match=r"reward.mix.three.frames=0 must be null"):
        build_reward({"name": "mix", "mix": {"three": {"reward": "jpeg_compressibility", "weight": 1, "frames": 0}}})
    with pytest.raises(RuntimeError, match=r"component 'three' \(required\) failed: ValueError: "
                                           r"reward.mix.three.frames=9 is more than the 5 frames"):
        build_reward({"name": "mix", "mix": {"three": {"reward": "jpeg_compressibility", "weight": 1, "frames": 9}}})(
            video, ["a", "b"], [{}, {}])


def test_config_validation_names_reward_frames():
    cfg = load_config(["reward=jpeg_compressibility", "reward.frames=3", "reward.frame_reduce=min"])
    assert cfg.reward.frames == 3 and cfg.reward.frame_reduce == "min"
    assert load_config(["reward=jpeg_compressibility", "reward.frames=null"]).reward.frames is None
    with pytest.raises(ConfigError, match=r"reward.frames=0 must be null \(every frame\) or an integer >= 1"):
        load_config(["reward=jpeg_compressibility", "reward.frames=0"])
    with pytest.raises(ConfigError, match=r"reward.frame_reduce='max' is not valid; allowed: mean, min"):
        load_config(["reward=jpeg_compressibility", "reward.frame_reduce=max"])
    with pytest.raises(ConfigError, match=r"reward.frames / reward.frame_reduce: reward http reads video itself"):
        load_config(["reward=http", "reward.url=http://x", "reward.frames=4"])
    cfg = load_config(["reward=mix", "reward.mix={jpeg_compressibility: {weight: 1, frames: 2, frame_reduce: min}}"])
    assert cfg.reward.mix.jpeg_compressibility.frames == 2
    with pytest.raises(ConfigError, match=r"reward.mix.jpeg_compressibility.frame_reduce='x' is not valid"):
        load_config(["reward=mix", "reward.mix={jpeg_compressibility: {weight: 1, frame_reduce: x}}"])


def test_serve_reward_cli_config_keeps_frames():
    cfg = reward_config(["reward=jpeg_compressibility", "reward.frames=4"])
    assert cfg == {"name": "jpeg_compressibility", "quality": 95, "frames": 4}
    assert build_reward(cfg).frame_sampling == FrameSampling(4, "mean")
    with pytest.raises(ConfigError, match=r"reward.frames=-1 must be null"):
        reward_config(["reward=jpeg_compressibility", "reward.frames=-1"])
    with pytest.raises(ConfigError, match=r"reward http reads video itself"):
        reward_config(["reward=http", "reward.url=http://x", "reward.frames=2"])


def test_serve_reward_cli_flags_reach_the_limits(monkeypatch):
    from polyrl.serving import cli, server

    made = {}
    monkeypatch.setattr(server, "create_app", lambda reward, name, limits, token: made.update(
        reward=reward, limits=limits) or "app")
    monkeypatch.setattr(server, "serve", lambda app, host, port, log_level: made.update(app=app))
    assert cli.main(["reward=jpeg_compressibility", "reward.frames=2", "reward.frame_reduce=min", "--max-frames", "9",
                     "--max-request-pixels", "1000", "--max-audio-seconds", "2.5"]) == 0
    assert made["app"] == "app" and made["reward"].frame_sampling == FrameSampling(2, "min")
    limits = made["limits"]
    assert (limits.max_frames, limits.max_request_pixels, limits.max_audio_seconds) == (9, 1000, 2.5)


# ---------------------------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def jpeg_video_server():
    """`polyrl serve-reward reward=jpeg_compressibility reward.frames=3`, in-process on a loopback port."""
    cfg = reward_config(["reward=jpeg_compressibility", "reward.frames=3"])
    limits = ServerLimits(max_body_bytes=2_000_000, max_images=4, max_image_pixels=32 * 32, max_frames=6,
                          max_request_pixels=3 * 6 * 32 * 32, max_audio_seconds=1.0)
    with BackgroundServer(create_app(build_reward(cfg), "jpeg_compressibility", limits)) as srv:
        yield srv


def _client(url, **kw):
    return build_reward({"name": "http", "url": url, "backoff": 0.01, "max_backoff": 0.05, **kw})


def test_a_5_frame_video_through_serve_reward_equals_the_local_reward(jpeg_video_server):
    video, prompts = _video(2, 5, 16, 16), ["a", "b"]
    local_reward = build_reward({"name": "jpeg_compressibility", "frames": 3})
    # frames transport (PNG, lossless): exactly the local reward on the same video
    local = call_reward(local_reward, video, prompts, [{}, {}])
    out = _client(jpeg_video_server.url, chunk_size=1)(video, prompts, [{}, {}])
    assert torch.equal(out.scores, local.scores)
    assert out.extras["jpeg/kilobytes"] == pytest.approx(local.extras["jpeg/kilobytes"])
    # mp4 transport: exactly the local reward on the decoded mp4 frames (and not on the original: mp4 is lossy)
    sent = stack_videos([decode_video(v, 5, 256) for v in encode_videos(video, "mp4", crf=18)])
    local_mp4 = call_reward(local_reward, sent, prompts, [{}, {}])
    out = _client(jpeg_video_server.url, video_format="mp4")(video, prompts, [{}, {}])
    assert torch.equal(out.scores, local_mp4.scores)
    assert not torch.equal(out.scores, local.scores)
    health = httpx.get(jpeg_video_server.url + "/health").json()
    assert health["media"] == ["images", "videos"] and health["limits"]["max_frames"] == 6


def test_one_request_may_mix_frame_lists_and_mp4s_of_one_shape(jpeg_video_server):
    video = _video(2, 5, 16, 16, seed=3)
    items = [encode_videos(video[:1], "frames")[0], encode_videos(video[1:], "mp4")[0]]
    resp = httpx.post(jpeg_video_server.url + "/score", json={"videos": items, "prompts": ["a", "b"]})
    assert resp.status_code == 200, resp.text
    local = build_reward({"name": "jpeg_compressibility", "frames": 3})
    assert resp.json()["scores"][0] == pytest.approx(call_reward(local, video[:1], ["a"], [{}]).scores.item())


def _post(srv, payload):
    return httpx.post(srv.url + "/score", json=payload, timeout=30)


def _frames(video):
    return encode_videos(video, "frames")


def test_video_and_audio_limits_are_413_before_decoding(jpeg_video_server):
    srv = jpeg_video_server
    # 7 frames over max_frames=6: junk frames, so a decode would have answered 422
    resp = _post(srv, {"videos": [["junk"] * 7], "prompts": ["a"]})
    assert resp.status_code == 413
    assert resp.json()["detail"] == "videos[0]: video of 7 frames is over the limit of 6 frames"
    mp4 = base64.b64encode(encode_mp4(video_to_uint8(_video(1, 7, 8, 8))[0], 8)).decode()
    resp = _post(srv, {"videos": [mp4], "prompts": ["a"]})
    assert resp.status_code == 413 and "videos[0]: video of 7 frames is over the limit of 6 frames" in resp.text
    resp = _post(srv, {"videos": _frames(_video(1, 2, 33, 32)), "prompts": ["a"]})
    assert resp.status_code == 413 and "videos[0]: frame 0: image of 32x33 = 1056 pixels is over the limit of 1024" \
        in resp.json()["detail"]
    mp4 = base64.b64encode(encode_mp4(video_to_uint8(_video(1, 2, 34, 32))[0], 8)).decode()
    resp = _post(srv, {"videos": [mp4], "prompts": ["a"]})
    assert resp.status_code == 413 and "video frames of 32x34 = 1088 pixels are over the limit of 1024" in resp.text
    # 3 videos x 6 frames x 32x32 is the request's pixel budget: a 4th video is refused at its first frame
    resp = _post(srv, {"videos": _frames(_video(3, 6, 32, 32)), "prompts": ["a"] * 3})
    assert resp.status_code == 200, resp.text
    resp = _post(srv, {"videos": _frames(_video(4, 6, 32, 32)), "prompts": ["a"] * 4})
    assert resp.status_code == 413 and "videos[3]: frame 0: the request decodes to more than 18432 pixels" in resp.text
    resp = _post(srv, {"videos": _frames(_video(5, 1, 4, 4)), "prompts": ["a"] * 5})
    assert resp.status_code == 413 and resp.json()["detail"] == "5 videos in one request; the limit is 4"


def test_audio_over_the_limit_is_413_before_the_samples_are_read():
    srv_reward = _Loudness()
    limits = ServerLimits(max_audio_seconds=1.0)
    header_only = bytearray(encode_wav(torch.zeros(1, 10), 16000))
    header_only[40:44] = (16001 * 2).to_bytes(4, "little")  # the data chunk claims 16001 samples; it holds 10
    with BackgroundServer(create_app(srv_reward, "loud", limits)) as srv:
        resp = _post(srv, {"audio": [base64.b64encode(bytes(header_only)).decode()], "prompts": ["a"]})
        assert resp.status_code == 413
        assert resp.json()["detail"] == "audio[0]: audio of 1.00006 s is over the limit of 1 s"
        limits.max_audio_seconds = 2.0  # the same file within the limit: now its samples are read, and missing
        resp = _post(srv, {"audio": [base64.b64encode(bytes(header_only)).decode()], "prompts": ["a"]})
        assert resp.status_code == 422 and "WAV data holds 10 samples, its header says 16001" in resp.text


def _wav_b64(n=100, rate=16000, channels=1):
    return encode_audio(Audio(torch.zeros(1, channels, n), rate))[0]


@pytest.mark.parametrize("payload, message", [
    ({"images": ["x"], "videos": [["x"]], "prompts": ["a"]}, "a request carries exactly one of images, videos, audio, "
                                                             "texts; got images, videos"),
    ({"prompts": ["a"]}, "a request carries exactly one of images, videos, audio, texts; got none"),
    ({"videos": [], "prompts": []}, "'videos' must be a non-empty list of videos"),
    ({"videos": [["x"]], "prompts": ["a", "b"]}, "got 1 videos but 2 prompts"),
    ({"videos": [["%%"]], "prompts": ["a"]}, "videos[0]: frame 0: not valid base64"),
    ({"videos": ["aGVsbG8="], "prompts": ["a"]}, "videos[0]: not a readable mp4"),
    ({"videos": [{"frames": []}], "prompts": ["a"]}, "videos[0]: a video must be a non-empty list"),
    ({"videos": _frames(_video(1, 2, 8, 8)) + _frames(_video(1, 3, 8, 8)), "prompts": ["a", "b"]},
     "all videos of a request must have the same frames and size (T, H, W), got [(2, 8, 8), (3, 8, 8)]"),
    ({"videos": _frames(_video(1, 2, 8, 8)) + _frames(_video(1, 2, 8, 6)), "prompts": ["a", "b"]},
     "same frames and size (T, H, W)"),
    ({"videos": [[encode_images(torch.zeros(1, 3, 8, 8))[0], encode_images(torch.zeros(1, 3, 4, 8))[0]]],
      "prompts": ["a"]}, "videos[0]: the frames of a video must have one size"),
    ({"audio": [_wav_b64()], "prompts": ["a"]}, "this server's reward cannot score audio; it accepts images, videos"),
    ({"videos": _frames(_video(1, 2, 8, 8)), "prompts": ["a"]},
     "the scorer rejected the input: ValueError: reward.frames=3 is more than the 2 frames of the video"),
])
def test_contract_violations_are_422(jpeg_video_server, payload, message):
    resp = _post(jpeg_video_server, payload)
    assert resp.status_code == 422 and message in resp.json()["detail"], resp.text


class _Loudness:
    """An audio scorer defined here: RMS in dB per clip; records the sample rates and batch sizes it saw."""

    media = ("audio",)

    def __init__(self, delay=0.0):
        self.delay, self.seen, self.lock = delay, [], threading.Lock()

    def __call__(self, audio, prompts, metadata):
        assert media_kind(audio) == "audio"
        time.sleep(self.delay)
        with self.lock:
            self.seen.append((len(audio), audio.sample_rate, tuple(audio.waveform.shape[1:])))
        rms = audio.waveform.double().pow(2).mean(dim=(1, 2)).sqrt()
        return RewardOutput((20 * torch.log10(rms)).float(), {"rate": [audio.sample_rate] * len(audio)})


def test_audio_through_the_server_equals_the_local_scorer(monkeypatch):
    monkeypatch.setitem(REWARDS, "_loud", _Loudness)
    t = torch.arange(800) / 16000
    wave_ = torch.stack([a * torch.sin(2 * math.pi * 440 * t + c) for a in (0.5, 0.1, 0.9) for c in (0.0, 1.0)])
    audio = Audio(wave_.view(3, 2, 800), 16000)
    reward = build_reward({"name": "_loud"})
    with BackgroundServer(create_app(reward, "_loud", ServerLimits(max_audio_seconds=1.0))) as srv:
        assert httpx.get(srv.url + "/health").json()["media"] == ["audio"]
        out = _client(srv.url, chunk_size=2)(audio, ["a", "b", "c"], [{}, {}, {}])
        # what the server scored is the int16-quantised waveform: exactly the local scorer on it
        sent = stack_audio([decode_audio(s, 1.0) for s in encode_audio(audio)])
        assert torch.equal(out.scores, _Loudness()(sent, ["a"] * 3, [{}] * 3).scores)
        assert out.scores.tolist() == pytest.approx(_Loudness()(audio, ["a"] * 3, [{}] * 3).scores.tolist(), abs=1e-3)
        assert out.extras["rate"] == [16000] * 3
        resp = _post(srv, {"images": encode_images(torch.zeros(1, 3, 4, 4)), "prompts": ["a"]})
        assert resp.status_code == 422 and "cannot score images; it accepts audio" in resp.text
        for payload, message in [
            ({"audio": [_wav_b64(rate=16000), _wav_b64(rate=8000)], "prompts": ["a", "b"]},
             "all audio of a request must have one sample rate, got [8000, 16000] Hz"),
            ({"audio": [_wav_b64(n=100), _wav_b64(n=99)], "prompts": ["a", "b"]},
             "same channels and length (channels, samples), got [(1, 99), (1, 100)]"),
            ({"audio": ["aGVsbG8="], "prompts": ["a"]}, "audio[0]: not a PCM WAV file"),
            ({"audio": ["@@"], "prompts": ["a"]}, "audio[0]: not valid base64"),
        ]:
            resp = _post(srv, payload)
            assert resp.status_code == 422 and message in resp.json()["detail"], resp.text


def test_requests_of_different_kinds_or_shapes_are_never_merged():
    class Recorder:
        media = ("images", "video", "audio")

        def __init__(self):
            self.calls, self.lock = [], threading.Lock()

        def __call__(self, media, prompts, metadata):
            time.sleep(0.05)
            kind = media_kind(media)
            audio = kind == "audio"
            shape = (*media.waveform.shape[1:], media.sample_rate) if audio else tuple(media.shape[1:])
            with self.lock:
                self.calls.append((kind, shape, len(prompts)))
            x = media.waveform if kind == "audio" else media
            return RewardOutput(x.flatten(1).double().mean(1).float(), {"i": [m["i"] for m in metadata]})

    reward = Recorder()
    v_a, v_b = _video(2, 3, 8, 8, seed=1), _video(2, 4, 8, 8, seed=2)
    audio = Audio(torch.rand(2, 1, 50, generator=torch.Generator().manual_seed(3)) - 0.5, 8000)
    payloads = [
        {"videos": _frames(v_a), "prompts": ["p"] * 2, "metadata": [{"i": 0}, {"i": 1}]},
        {"videos": _frames(v_a.flip(0)), "prompts": ["p"] * 2, "metadata": [{"i": 2}, {"i": 3}]},
        {"videos": _frames(v_b), "prompts": ["p"] * 2, "metadata": [{"i": 4}, {"i": 5}]},
        {"audio": encode_audio(audio), "prompts": ["p"] * 2, "metadata": [{"i": 6}, {"i": 7}]},
        {"images": encode_images(v_a[:, 0]), "prompts": ["p"] * 2, "metadata": [{"i": 8}, {"i": 9}]},
    ]
    with BackgroundServer(create_app(reward, "rec", ServerLimits(max_batch=16, max_wait_ms=100))) as srv:
        with ThreadPoolExecutor(5) as pool:
            bodies = list(pool.map(lambda p: _post(srv, p).json(), payloads))
    for k, body in enumerate(bodies):
        assert body["extras"]["i"] == [2 * k, 2 * k + 1]
    q = lambda x: torch.round(x * 255) / 255  # noqa: E731  (PNG frames carry the uint8 video)
    assert bodies[0]["scores"] == pytest.approx(q(v_a).flatten(1).mean(1).tolist(), abs=1e-6)
    assert bodies[1]["scores"] == pytest.approx(q(v_a.flip(0)).flatten(1).mean(1).tolist(), abs=1e-6)
    assert bodies[2]["scores"] == pytest.approx(q(v_b).flatten(1).mean(1).tolist(), abs=1e-6)
    assert bodies[3]["scores"] == pytest.approx(audio.waveform.flatten(1).mean(1).tolist(), abs=1e-4)
    keys = {(kind, shape) for kind, shape, _ in reward.calls}
    assert keys == {("video", (3, 3, 8, 8)), ("video", (4, 3, 8, 8)), ("audio", (1, 50, 8000)), ("images", (3, 8, 8))}
    assert sum(n for _, _, n in reward.calls) == 10
    assert len(reward.calls) < 5  # the two same-shape video requests were merged into one call
