"""Media on the wire (polyrl/rewards/codec.py): round trips of PNG frames (exact), mp4 (within a stated
tolerance), WAV (within 1/32768); limits refused from the header before anything is decoded; bad input."""

import base64
import io
import struct

import av
import numpy as np
import pytest
import torch

from polyrl.rewards import Audio
from polyrl.rewards import codec as C
from polyrl.rewards.codec import (
    MediaDecodeError,
    MediaTooLarge,
    PixelBudget,
    decode_audio,
    decode_mp4,
    decode_video,
    decode_wav,
    encode_audio,
    encode_mp4,
    encode_videos,
    encode_wav,
    stack_audio,
    stack_videos,
    video_to_uint8,
)


def smooth_video(b, t, h, w, seed=0):
    """(B, T, 3, H, W) in [0, 1]: coloured gradients that move a little per frame (what a generator makes;
    noise would be the worst case for mp4)."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.linspace(0, 1, h)[:, None], torch.linspace(0, 1, w)[None]
    base = torch.rand(b, 1, 3, 1, 1, generator=g) * 0.5 + 0.25
    wave_ = torch.sin(3 * x + 2 * y + 0.3 * torch.arange(t)[:, None, None, None]) ** 2  # (T, 1, H, W)
    return (0.6 * base + 0.4 * wave_[None]).clamp(0, 1)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# ---------------------------------------------------------------------------------------------- video
def test_png_frames_round_trip_exactly():
    video = torch.rand(2, 5, 3, 9, 7, generator=torch.Generator().manual_seed(0))  # odd sizes, noise
    items = encode_videos(video, "frames")
    assert len(items) == 2 and all(isinstance(v, list) and len(v) == 5 for v in items)
    back = stack_videos([decode_video(v, max_frames=5, max_pixels=63) for v in items])
    assert back.shape == video.shape and back.dtype == torch.float32
    assert torch.equal(back, torch.round(video * 255) / 255)  # exactly what a local scorer sees after round(x*255)
    jpeg = stack_videos([decode_video(v, 5, 63) for v in encode_videos(video, "frames", image_format="jpeg")])
    assert jpeg.shape == video.shape and not torch.equal(jpeg, back)  # JPEG frames: accepted, lossy


def test_mp4_round_trip_within_tolerance():
    """Stated tolerance (docs/rewards.md): smooth content at crf 18 comes back with a mean absolute error under
    3 levels of 255 and no pixel off by 16 or more; odd sizes round-trip (yuv444p)."""
    for t, h, w in [(5, 32, 32), (4, 15, 17)]:
        frames = video_to_uint8(smooth_video(1, t, h, w))[0]
        data = encode_mp4(frames, fps=8)
        back = decode_mp4(data, max_frames=t, max_pixels=h * w)
        assert back.shape == frames.shape and back.dtype == np.uint8
        err = np.abs(back.astype(int) - frames.astype(int))
        assert err.mean() < 3 and err.max() < 16, (t, h, w, err.mean(), err.max())
        assert err.max() > 0  # lossy: a test that compares mp4 results to the original would notice
        with av.open(io.BytesIO(data)) as c:
            s = c.streams.video[0]
            assert s.codec_context.pix_fmt == ("yuv420p" if h % 2 == 0 and w % 2 == 0 else "yuv444p")
            assert s.average_rate == 8 and s.frames == t
    noise = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    err = np.abs(decode_mp4(encode_mp4(noise, 8), 3, 256).astype(int) - noise)
    assert err.mean() > 10  # noise is far off with 4:2:0: why PNG frames are the lossless default


def test_encode_mp4_arguments():
    frames = np.zeros((2, 6, 6, 3), np.uint8)
    with pytest.raises(ValueError, match=r"fps=0 must be a finite number > 0"):
        encode_mp4(frames, 0)
    with pytest.raises(ValueError, match=r"expects uint8 frames"):
        encode_mp4(frames.astype(np.float32), 8)
    with pytest.raises(ValueError, match=r"yuv420p needs an even height and width, got 5x6"):
        encode_mp4(np.zeros((2, 5, 6, 3), np.uint8), 8, pix_fmt="yuv420p")
    with av.open(io.BytesIO(encode_mp4(frames, 23.976))) as c:
        assert float(c.streams.video[0].average_rate) == pytest.approx(23.976)


def test_mpeg4_fallback_without_libx264(monkeypatch):
    monkeypatch.setattr(C, "_mp4_codec", lambda: "mpeg4")
    frames = video_to_uint8(smooth_video(1, 3, 16, 16))[0]
    data = encode_mp4(frames, 8)
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].codec_context.name == "mpeg4"
    assert decode_mp4(data, 3, 256).shape == frames.shape
    assert decode_video(encode_videos(smooth_video(1, 3, 16, 16), "mp4")[0], 3, 256).shape == frames.shape
    with pytest.raises(ValueError, match=r"no libx264; its mpeg4 encoder needs yuv420p and an even size, got 15x16"):
        encode_mp4(np.zeros((2, 15, 16, 3), np.uint8), 8)


def _corrupt_mdat(data: bytes) -> bytes:
    """The same mp4 header, its frame data zeroed: decoding it fails, reading its header does not."""
    i = data.index(b"mdat")
    size = int.from_bytes(data[i - 4 : i], "big")
    return data[: i + 4] + bytes(size - 8) + data[i - 4 + size :]


def test_mp4_limits_are_read_from_the_header_before_decoding():
    data = encode_mp4(video_to_uint8(smooth_video(1, 5, 16, 16))[0], 8)
    broken = _corrupt_mdat(data)
    with pytest.raises(MediaDecodeError):  # decoding the zeroed frames fails ...
        decode_mp4(broken, 5, 256)
    # ... so these limits fired before any frame was decoded
    with pytest.raises(MediaTooLarge, match=r"video of 5 frames is over the limit of 4 frames"):
        decode_mp4(broken, 4, 256)
    with pytest.raises(MediaTooLarge, match=r"video frames of 16x16 = 256 pixels are over the limit of 255 pixels"):
        decode_mp4(broken, 5, 255)
    with pytest.raises(MediaTooLarge, match=r"more than 1000 pixels in all"):
        decode_mp4(broken, 5, 256, budget=PixelBudget(1000))  # 5 x 256 > 1000


def test_frame_lists_are_counted_before_decoding():
    junk = ["not base64!"] * 6
    with pytest.raises(MediaTooLarge, match=r"video of 6 frames is over the limit of 5 frames"):
        decode_video(junk, max_frames=5, max_pixels=10**6)
    with pytest.raises(MediaDecodeError, match=r"frame 0: not valid base64"):
        decode_video(junk, max_frames=6, max_pixels=10**6)
    frames = encode_videos(smooth_video(1, 3, 8, 8), "frames")[0]
    with pytest.raises(MediaTooLarge, match=r"frame 0: image of 8x8 = 64 pixels is over the limit of 63"):
        decode_video(frames, 3, 63)
    with pytest.raises(MediaTooLarge, match=r"frame 2: the request decodes to more than 150 pixels"):
        decode_video(frames, 3, 64, PixelBudget(150))


@pytest.mark.parametrize("item, message", [
    ([], "a video must be a non-empty list"),
    (7, "a video must be a non-empty list"),
    ("aGVsbG8=", "not a readable mp4"),
    ("%%%", "not valid base64"),
    (["aGVsbG8="], "frame 0: not a PNG or JPEG image"),
])
def test_bad_videos(item, message):
    with pytest.raises(MediaDecodeError, match=message):
        decode_video(item, 10, 10**6)


def test_frames_of_one_video_and_videos_of_one_request_share_a_shape():
    a, b = encode_videos(smooth_video(1, 2, 8, 8), "frames")[0], encode_videos(smooth_video(1, 2, 8, 6), "frames")[0]
    with pytest.raises(MediaDecodeError, match=r"the frames of a video must have one size"):
        decode_video([a[0], b[0]], 10, 10**6)
    clips = [decode_video(v, 10, 10**6) for v in (a, b)]
    with pytest.raises(MediaDecodeError, match=r"same frames and size \(T, H, W\), got \[\(2, 8, 6\), \(2, 8, 8\)\]"):
        stack_videos(clips)


# ---------------------------------------------------------------------------------------------- audio
def test_wav_round_trip_within_one_int16_step():
    g = torch.Generator().manual_seed(0)
    wave_ = torch.rand(2, 3, 401, generator=g) * 2 - 1
    wave_[0, 0, :4] = torch.tensor([1.0, -1.0, 0.0, 0.5])
    audio = Audio(wave_, 22050)
    clips = [decode_audio(s, max_seconds=1.0) for s in encode_audio(audio)]
    back = stack_audio(clips)
    assert back.sample_rate == 22050 and back.waveform.shape == (2, 3, 401) and back.waveform.dtype == torch.float32
    err = (back.waveform.double() - wave_.double()).abs()
    assert err.max() <= 1 / 32768 + 1e-12
    assert back.waveform[0, 0, :4].tolist() == [32767 / 32768, -1.0, 0.0, 0.5]  # 1.0 clips to the largest int16
    exact = torch.randint(-32768, 32768, (1, 2, 50), generator=g).float() / 32768  # representable: exact
    assert torch.equal(stack_audio([decode_audio(s, 1.0) for s in encode_audio(Audio(exact, 8000))]).waveform, exact)


def _wav(channels=1, width=2, rate=16000, frames=b"\0\0" * 10, nframes=None):
    """A PCM WAV by hand, so that its header may claim `nframes` samples that its data does not hold."""
    data_len = len(frames) if nframes is None else nframes * channels * width
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * width, channels * width, 8 * width)
    return (b"RIFF" + struct.pack("<I", 36 + data_len) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_len) + frames)


def test_wav_length_is_refused_from_the_header():
    # the header claims 16000 * 61 samples; the data holds 10: decoding would fail, the limit fires first
    header_only = _wav(nframes=16000 * 61)
    with pytest.raises(MediaTooLarge, match=r"audio of 61 s is over the limit of 60 s"):
        decode_wav(header_only, max_seconds=60)
    with pytest.raises(MediaDecodeError, match=r"WAV data holds 10 samples, its header says 976000"):
        decode_wav(header_only, max_seconds=100)


@pytest.mark.parametrize("data, message", [
    (b"RIFF1234WAVEjunk", "not a PCM WAV file"),
    (b"hello", "not a PCM WAV file"),
    (_wav(width=1, frames=b"\0" * 10), "WAV of 8-bit samples is not accepted; send 16-bit PCM"),
    (_wav(frames=b""), "WAV data holds 0 samples"),
])
def test_bad_wavs(data, message):
    with pytest.raises(MediaDecodeError, match=message):
        decode_wav(data, 60)


def test_audio_of_one_request_shares_rate_and_shape():
    a = decode_wav(encode_wav(torch.zeros(1, 10), 16000), 1)
    with pytest.raises(MediaDecodeError, match=r"one sample rate, got \[8000, 16000\] Hz"):
        stack_audio([a, decode_wav(encode_wav(torch.zeros(1, 10), 8000), 1)])
    with pytest.raises(MediaDecodeError, match=r"same channels and length .* got \[\(1, 10\), \(1, 11\)\]"):
        stack_audio([a, decode_wav(encode_wav(torch.zeros(1, 11), 16000), 1)])
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        decode_audio("###", 1)
    assert decode_audio("data:audio/wav;base64," + _b64(encode_wav(torch.zeros(2, 5), 8000)), 1)[0].shape == (2, 5)
