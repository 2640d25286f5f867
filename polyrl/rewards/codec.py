"""Media on the wire, both ways, with size checks before pixel or sample data is decoded.

* images: base64 PNG (lossless) or JPEG.
* video: a list of base64 PNG/JPEG frames (lossless with PNG), or one base64 mp4 (H.264 via PyAV; lossy).
* audio: base64 WAV, 16-bit PCM (the stdlib `wave` module), the sample rate in its header.

PNG keeps the uint8 image exactly, so a served scorer sees what a local one would after the usual
`round(x * 255)` quantisation. mp4 does not: H.264 quantises, and with 4:2:0 chroma also halves the colour
resolution; a scorer sees the decoded frames (`decode_mp4`), typically within a few levels of 255 of the
originals on smooth content and much further on noise. WAV keeps int16 samples exactly: a waveform
survives within 1/32768.

Every decoder takes limits and raises `MediaTooLarge` (the server answers 413) from the file's header, before
the pixels or samples are decoded, and `MediaDecodeError` (422) for anything that is not a valid file of the
expected kind. The trainer writes its sample videos with `encode_mp4`.

Images and video are read in two steps, so a server can budget memory before spending it: `read_image` /
`read_video` check the headers and charge a `PixelBudget` (no pixel is decoded), then `decode_image_file` /
`decode_video_file` decode the uint8 pixels, into a caller's array when given one.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from PIL import Image

from .base import Audio

FORMATS = ("png", "jpeg")  # image (and video frame) formats
VIDEO_FORMATS = ("frames", "mp4")
MP4_PIX_FMTS = ("yuv420p", "yuv444p")
TRANSPORT_FPS = 24.0  # the frame rate written into mp4s sent to a reward server (the tensor contract has no fps)


class MediaDecodeError(ValueError):
    """Media that is not valid base64 PNG/JPEG, mp4 or WAV, or a batch that breaks the contract (422)."""


class MediaTooLarge(ValueError):
    """Media over a limit (413); raised from the header, before the pixels or samples are decoded."""


class PixelBudget:
    """Decoded pixels left for one request (all its images or frames together): a small mp4 or PNG can
    decode to gigabytes, so every image and frame is charged from its header before it is decoded."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0

    def take(self, pixels: int) -> None:
        self.used += int(pixels)
        if self.used > self.limit:
            raise MediaTooLarge(f"the request decodes to more than {self.limit} pixels in all (the per-request limit)")


def _b64(data) -> bytes:
    """Strict base64 (a `data:...;base64,` prefix is allowed) -> bytes."""
    if not isinstance(data, str):
        raise MediaDecodeError(f"expected a base64 string, got {type(data).__name__}")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaDecodeError(f"not valid base64 ({e})") from None


def _b64str(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# ---------------------------------------------------------------------------------------------- images
def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, rounded as every built-in scorer rounds."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape (B, 3, H, W), got {tuple(images.shape)}")
    return (images.detach().float().clamp(0, 1).mul(255).round()).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def encode_image_bytes(pixels: np.ndarray, fmt: str = "png", quality: int = 95) -> bytes:
    """One (H, W, 3) uint8 image as PNG or JPEG file bytes."""
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # lossless; level 1 is the fast one
    elif fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    else:
        raise ValueError(f"image format {fmt!r} is not supported; allowed: {', '.join(FORMATS)}")
    return buf.getvalue()


def encode_images(images: torch.Tensor, fmt: str = "png", quality: int = 95) -> list[str]:
    """(B, 3, H, W) float in [0, 1] -> B base64 strings of PNG/JPEG files."""
    return [_b64str(encode_image_bytes(a, fmt, quality)) for a in to_uint8(images)]


@dataclass(frozen=True)
class ImageFile:
    """One PNG/JPEG whose header was read (size checked and charged), its pixels not yet decoded."""

    data: bytes
    height: int
    width: int


def read_image(data: str | bytes, max_pixels: int, budget: PixelBudget | None = None) -> ImageFile:
    """A base64 PNG/JPEG (a `data:image/...;base64,` prefix is allowed) or its file bytes -> its header, without
    decoding its pixels: `MediaTooLarge` over `max_pixels` or over what is left of `budget` (which is charged)."""
    raw = data if isinstance(data, bytes) else _b64(data)
    try:
        img = Image.open(io.BytesIO(raw))
    except Exception as e:  # PIL raises several types for non-images
        raise MediaDecodeError(f"not a PNG or JPEG image ({type(e).__name__})") from None
    if img.format not in ("PNG", "JPEG"):
        raise MediaDecodeError(f"image format {img.format} is not accepted; send PNG or JPEG")
    w, h = img.size
    if w * h > max_pixels:
        raise MediaTooLarge(f"image of {w}x{h} = {w * h} pixels is over the limit of {max_pixels} pixels")
    if budget is not None:
        budget.take(w * h)
    return ImageFile(raw, h, w)


def decode_image_file(image: ImageFile, out: np.ndarray | None = None) -> np.ndarray:
    """The (H, W, 3) uint8 RGB pixels of a read image, written into `out` when given (no float copy is made)."""
    try:
        img = Image.open(io.BytesIO(image.data))
        if img.size != (image.width, image.height):  # the bytes were read before: only a bug changes them
            raise MediaDecodeError(f"the image's size changed from {image.width}x{image.height} to {img.size}")
        pixels = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
    except MediaDecodeError:
        raise
    except Exception as e:  # truncated or corrupt pixel data
        raise MediaDecodeError(f"could not decode the image ({type(e).__name__}: {e})") from None
    if out is None:
        return pixels
    out[...] = pixels
    return out


def decode_image(data: str, max_pixels: int, budget: PixelBudget | None = None) -> np.ndarray:
    """A base64 PNG/JPEG (a `data:image/...;base64,` prefix is allowed) -> (H, W, 3) uint8.

    The header is read first, so an image over `max_pixels` (or over what is left of `budget`) is refused
    without decoding its pixels.
    """
    return decode_image_file(read_image(data, max_pixels, budget))


def one_size(shapes: list[tuple], what: str) -> tuple:
    """The one shape of a request's images ((H, W)) or videos ((T, H, W)); `MediaDecodeError` naming them all
    when they differ."""
    distinct = sorted(set(shapes))
    if len(distinct) > 1:
        if what == "images":
            raise MediaDecodeError(f"all images of a request must have one size, got {distinct}")
        raise MediaDecodeError(f"all videos of a request must have the same frames and size (T, H, W), got {distinct}")
    return distinct[0]


def stack_images(pixels: list[np.ndarray]) -> torch.Tensor:
    """Equal-sized (H, W, 3) uint8 images -> (B, 3, H, W) float32 in [0, 1]."""
    one_size([p.shape[:2] for p in pixels], "images")
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float().div(255.0)


# ---------------------------------------------------------------------------------------------- mp4
def _mp4_codec() -> str:
    """libx264 when the installed PyAV has it (the PyPI wheels do), else MPEG-4 part 2 (4:2:0 only)."""
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def encode_mp4(frames: np.ndarray, fps: float, *, crf: int = 18, pix_fmt: str | None = None,
               audio: np.ndarray | None = None, sample_rate: int = 0, audio_titles: list[str] | None = None) -> bytes:
    """(T, H, W, 3) uint8 RGB frames -> mp4 file bytes (H.264; lossy).

    `audio`: (tracks, channels, samples) float waveforms in [-1, 1] at `sample_rate` Hz (1 or 2 channels), each
    written as its own AAC stream (a player plays the first and lets you switch), titled by `audio_titles`.

    `pix_fmt=None` picks yuv420p when H and W are even (it plays everywhere) and yuv444p otherwise (4:2:0 cannot
    hold an odd size; 4:4:4 round-trips any size, but some browsers do not play it). `crf`: x264's constant
    quality (0 best, 51 worst; 18 is about visually lossless). Without libx264 (a PyAV built without it) the
    encoder is MPEG-4 part 2 at a high bit rate, which needs an even H and W.
    """
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] < 1:
        raise ValueError(f"encode_mp4 expects uint8 frames (T >= 1, H, W, 3), got {frames.dtype} {frames.shape}")
    if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
        raise ValueError(f"encode_mp4: fps={fps!r} must be a finite number > 0")
    if pix_fmt is not None and pix_fmt not in MP4_PIX_FMTS:
        raise ValueError(f"encode_mp4: pix_fmt={pix_fmt!r} is not supported; allowed: {', '.join(MP4_PIX_FMTS)}")
    _, h, w, _ = frames.shape
    if audio is not None:
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 3 or audio.shape[1] not in (1, 2) or audio.shape[2] < 1:
            raise ValueError(f"encode_mp4: audio must be (tracks, 1 or 2 channels, samples), got {audio.shape}")
        if not (isinstance(sample_rate, int) and sample_rate > 0):
            raise ValueError(f"encode_mp4: sample_rate={sample_rate!r} must be a positive integer with audio")
    codec = _mp4_codec()
    even = h % 2 == 0 and w % 2 == 0
    if codec != "libx264":
        if not even or pix_fmt == "yuv444p":
            raise ValueError(f"encode_mp4: this PyAV has no libx264; its mpeg4 encoder needs yuv420p and an even size, "
                             f"got {h}x{w} (send the frames as PNG instead)")
        pix_fmt = "yuv420p"
    pix_fmt = pix_fmt or ("yuv420p" if even else "yuv444p")
    if pix_fmt == "yuv420p" and not even:
        raise ValueError(f"encode_mp4: yuv420p needs an even height and width, got {h}x{w}; use pix_fmt='yuv444p'")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        if codec == "libx264":
            stream.options = {"crf": str(int(crf))}
        else:
            stream.bit_rate = int(max(1e6, w * h * float(fps) * 2))
        titles = list(audio_titles or [])
        audio_streams = [(_add_audio_stream(container, track.shape[0], sample_rate,
                                            titles[i] if i < len(titles) else None), track)
                         for i, track in enumerate(audio if audio is not None else [])]
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        for audio_stream, track in audio_streams:
            _mux_audio(container, audio_stream, track, sample_rate)
    return buf.getvalue()


def _add_audio_stream(container, channels: int, sample_rate: int, title: str | None):
    """An AAC stream for (channels, samples) waveforms (added before any packet: the header lists every stream)."""
    stream = container.add_stream("aac", rate=sample_rate)
    stream.layout = "mono" if channels == 1 else "stereo"
    if title:
        stream.metadata["title"] = title
    return stream


def _mux_audio(container, stream, track: np.ndarray, sample_rate: int) -> None:
    """One (channels, samples) float waveform through `stream` (PyAV re-buffers it to AAC's frame size)."""
    import av

    layout = "mono" if track.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(np.clip(track, -1, 1)), format="fltp", layout=layout)
    frame.sample_rate, frame.pts = sample_rate, 0
    container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


@dataclass(frozen=True)
class VideoFile:
    """One video whose headers were read (frame count and size checked and charged), not yet decoded: an mp4
    (`mp4`) or a list of PNG/JPEG frames (`frames`)."""

    frames: int
    height: int
    width: int
    mp4: bytes | None = None
    frame_files: tuple[ImageFile, ...] = ()


def read_mp4(data: bytes, max_frames: int, max_pixels: int, budget: PixelBudget | None = None) -> VideoFile:
    """mp4 file bytes -> its header, without decoding a frame.

    Only the mp4 demuxer is used (no format probing: a playlist or image-sequence format could read other
    files). Size and frame count come from the header; when the header does not state the count, the packets are
    counted without decoding them (stopped at `max_frames` + 1). `MediaTooLarge` over a limit; `budget` is charged
    frames * width * height.
    """
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", format="mp4")
    except Exception as e:  # av.error.* for anything that is not an mp4
        raise MediaDecodeError(f"not a readable mp4 ({type(e).__name__}: {e})") from None
    with container:
        if not container.streams.video:
            raise MediaDecodeError("the mp4 has no video stream")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w <= 0 or h <= 0:
            raise MediaDecodeError(f"the mp4's video stream has no valid size ({w}x{h})")
        if w * h > max_pixels:
            raise MediaTooLarge(f"video frames of {w}x{h} = {w * h} pixels are over the limit of {max_pixels} pixels")
        frames = stream.frames
        if frames > max_frames:
            raise MediaTooLarge(f"video of {frames} frames is over the limit of {max_frames} frames")
        if not frames:  # no count in the header: one packet per frame in an mp4 video stream
            try:
                for packet in container.demux(stream):
                    frames += packet.size > 0
                    if frames > max_frames:
                        raise MediaTooLarge(f"video of more than {max_frames} frames is over the limit of "
                                            f"{max_frames} frames")
            except MediaTooLarge:
                raise
            except Exception as e:
                raise MediaDecodeError(f"could not read the mp4 ({type(e).__name__}: {e})") from None
            if not frames:
                raise MediaDecodeError("the mp4 holds no video frames")
    if budget is not None:
        budget.take(frames * w * h)
    return VideoFile(frames, h, w, mp4=data)


def _decode_mp4_into(video: VideoFile, out: np.ndarray) -> None:
    import av

    n = 0
    try:
        with av.open(io.BytesIO(video.mp4), mode="r", format="mp4") as container:
            for frame in container.decode(container.streams.video[0]):
                if n == video.frames:  # never more than was charged
                    raise MediaDecodeError(f"the mp4 decodes to more frames than its header's {video.frames}")
                if (frame.width, frame.height) != (video.width, video.height):
                    raise MediaDecodeError(f"the mp4 changes frame size mid-stream ({video.width}x{video.height} "
                                           f"-> {frame.width}x{frame.height})")
                out[n] = frame.to_ndarray(format="rgb24")
                n += 1
    except MediaDecodeError:
        raise
    except Exception as e:  # corrupt bitstream
        raise MediaDecodeError(f"could not decode the mp4 ({type(e).__name__}: {e})") from None
    if n != video.frames:
        raise MediaDecodeError(f"the mp4 decoded to {n} frames, its header says {video.frames} (truncated?)")


def decode_video_file(video: VideoFile, out: np.ndarray | None = None) -> np.ndarray:
    """The (T, H, W, 3) uint8 RGB frames of a read video, written into `out` when given."""
    if out is None:
        out = np.empty((video.frames, video.height, video.width, 3), np.uint8)
    if video.mp4 is not None:
        _decode_mp4_into(video, out)
    else:
        for j, frame in enumerate(video.frame_files):
            try:
                decode_image_file(frame, out[j])
            except MediaDecodeError as e:
                raise MediaDecodeError(f"frame {j}: {e}") from None
    return out


def decode_mp4(data: bytes, max_frames: int, max_pixels: int, budget: PixelBudget | None = None) -> np.ndarray:
    """mp4 file bytes -> (T, H, W, 3) uint8 RGB; the limits are checked on the header first (`read_mp4`)."""
    return decode_video_file(read_mp4(data, max_frames, max_pixels, budget))


# ---------------------------------------------------------------------------------------------- video
def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """(B, T, 3, H, W) float in [0, 1] -> (B, T, H, W, 3) uint8 (the same rounding as `to_uint8`)."""
    if video.ndim != 5 or video.shape[2] != 3:
        raise ValueError(f"expected video of shape (B, T, 3, H, W), got {tuple(video.shape)}")
    return to_uint8(video.flatten(0, 1)).reshape(video.shape[0], video.shape[1], *video.shape[3:], 3)


def encode_videos(video: torch.Tensor, fmt: str = "frames", image_format: str = "png", quality: int = 95,
                  crf: int = 18) -> list:
    """(B, T, 3, H, W) float in [0, 1] -> B videos: each a list of T base64 PNG/JPEG frames (`fmt="frames"`) or
    one base64 mp4 string (`fmt="mp4"`, yuv444p at constant quality `crf`: no chroma subsampling, any size;
    yuv420p where PyAV has no libx264)."""
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"video format {fmt!r} is not supported; allowed: {', '.join(VIDEO_FORMATS)}")
    clips = video_to_uint8(video)
    if fmt == "mp4":
        pix_fmt = "yuv444p" if _mp4_codec() == "libx264" else None
        return [_b64str(encode_mp4(c, TRANSPORT_FPS, crf=crf, pix_fmt=pix_fmt)) for c in clips]
    return [[_b64str(encode_image_bytes(f, image_format, quality)) for f in c] for c in clips]


def read_video(item, max_frames: int, max_pixels: int, budget: PixelBudget | None = None) -> VideoFile:
    """One video on the wire (a list of base64 PNG/JPEG frames, or a base64 mp4 string) -> its headers, checked
    and charged to `budget`, before any frame is decoded; the frame count of a list is checked before anything
    is read."""
    if isinstance(item, str):
        return read_mp4(_b64(item), max_frames, max_pixels, budget)
    if not isinstance(item, list) or not item:
        raise MediaDecodeError("a video must be a non-empty list of base64 PNG/JPEG frames or a base64 mp4 string")
    if len(item) > max_frames:
        raise MediaTooLarge(f"video of {len(item)} frames is over the limit of {max_frames} frames")
    frames = []
    for j, frame in enumerate(item):
        try:
            frames.append(read_image(frame, max_pixels, budget))
        except (MediaTooLarge, MediaDecodeError) as e:
            raise type(e)(f"frame {j}: {e}") from None
    sizes = sorted({(f.height, f.width) for f in frames})
    if len(sizes) > 1:
        raise MediaDecodeError(f"the frames of a video must have one size, got {sizes}")
    return VideoFile(len(frames), *sizes[0], frame_files=tuple(frames))


def decode_video(item, max_frames: int, max_pixels: int, budget: PixelBudget | None = None) -> np.ndarray:
    """One video on the wire (a list of base64 PNG/JPEG frames, or a base64 mp4 string) -> (T, H, W, 3) uint8.

    The frame count is checked before any frame is decoded, and each frame's size from its header."""
    return decode_video_file(read_video(item, max_frames, max_pixels, budget))


def stack_videos(clips: list[np.ndarray]) -> torch.Tensor:
    """Videos of one shape, each (T, H, W, 3) uint8 -> (B, T, 3, H, W) float32 in [0, 1]."""
    one_size([c.shape[:3] for c in clips], "videos")
    return torch.from_numpy(np.stack(clips)).permute(0, 1, 4, 2, 3).float().div(255.0)


# ---------------------------------------------------------------------------------------------- audio
def encode_wav(waveform, sample_rate: int) -> bytes:
    """One clip (channels, samples) float in [-1, 1] -> WAV bytes, 16-bit PCM: round(x * 32768) clipped to
    [-32768, 32767], so `decode_wav` gives the waveform back within 1/32768."""
    x = torch.as_tensor(waveform).detach().to("cpu", torch.float64)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"encode_wav expects a waveform (channels, samples), got {tuple(x.shape)}")
    if int(sample_rate) != sample_rate or sample_rate <= 0:
        raise ValueError(f"encode_wav: sample_rate={sample_rate!r} must be a positive integer (Hz)")
    pcm = x.mul(32768.0).round().clamp(-32768, 32767).to(torch.int16).numpy()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(np.ascontiguousarray(pcm.T).astype("<i2").tobytes())  # interleaved, little-endian
    return buf.getvalue()


def decode_wav(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """WAV bytes (16-bit PCM) -> (waveform (channels, samples) float32 in [-1, 1), sample rate).

    The length is read from the header and refused (`MediaTooLarge`) before the samples are read."""
    try:
        w = wave.open(io.BytesIO(data), "rb")
    except (wave.Error, EOFError) as e:
        raise MediaDecodeError(f"not a PCM WAV file ({e})") from None
    with w:
        channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
        if width != 2:
            raise MediaDecodeError(f"WAV of {8 * width}-bit samples is not accepted; send 16-bit PCM")
        if rate <= 0 or channels <= 0:
            raise MediaDecodeError(f"WAV header has {channels} channels at {rate} Hz")
        if n > max_seconds * rate:
            raise MediaTooLarge(f"audio of {n / rate:g} s is over the limit of {max_seconds:g} s")
        raw = w.readframes(n)
    if len(raw) != n * channels * 2 or n == 0:
        raise MediaDecodeError(f"WAV data holds {len(raw) // (2 * channels)} samples, its header says {n}")
    pcm = np.frombuffer(raw, dtype="<i2").reshape(n, channels).T
    return pcm.astype(np.float32) / 32768.0, rate


def encode_audio(audio: Audio) -> list[str]:
    """An `Audio` batch -> B base64 WAV strings (16-bit PCM)."""
    return [_b64str(encode_wav(clip, audio.sample_rate)) for clip in audio.waveform]


def decode_audio(data: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """One base64 WAV -> (waveform (channels, samples) float32, sample rate)."""
    return decode_wav(_b64(data), max_seconds)


def stack_audio(clips: list[tuple[np.ndarray, int]]) -> Audio:
    """Clips of one sample rate, channel count and length -> an `Audio` batch."""
    rates = sorted({r for _, r in clips})
    if len(rates) > 1:
        raise MediaDecodeError(f"all audio of a request must have one sample rate, got {rates} Hz")
    shapes = sorted({c.shape for c, _ in clips})
    if len(shapes) > 1:
        raise MediaDecodeError(f"all audio of a request must have the same channels and length (channels, samples), "
                               f"got {shapes}")
    return Audio(torch.from_numpy(np.stack([c for c, _ in clips])), rates[0])
