"""Sample files of audio-only models: the tiles' waveforms as one WAV and their spectrograms as a captioned PNG grid.

`samples/step_N.wav` holds the grid's clips one after another in tile order, with `GAP_SECONDS` of silence between
them; `samples/step_N.png` shows each clip's log-magnitude spectrogram (time left to right, low frequencies at the
bottom, `DB_RANGE` dB below the grid's loudest bin shown black) captioned with its prompt and reward.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

GAP_SECONDS = 0.5
DB_RANGE = 80.0
TILE_HEIGHT, TILE_WIDTH = 64, 128  # spectrogram tiles before the grid's 2× scale


def stft_window(sample_rate: int) -> int:
    """FFT size: the power of two nearest 46 ms (2048 at 44.1 kHz, 1024 at 24 kHz), at least 16 samples."""
    return max(16, 2 ** round(math.log2(0.046 * sample_rate)))


def spectrogram_db(waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """(B, channels, samples) -> (B, F, T) power in dB, 10·log10(|STFT|² + 1e-10), of the channel mean
    (Hann window of `stft_window` samples, hop a quarter of it, centred frames)."""
    n_fft = stft_window(sample_rate)
    mono = waveform.detach().float().cpu().mean(1)
    if mono.shape[-1] < n_fft // 2 + 1:  # reflect padding needs more than half a window
        mono = torch.nn.functional.pad(mono, (0, n_fft // 2 + 1 - mono.shape[-1]))
    spec = torch.stft(mono, n_fft, hop_length=n_fft // 4, window=torch.hann_window(n_fft), return_complex=True)
    return 10 * torch.log10(spec.abs() ** 2 + 1e-10)


def spectrogram_images(waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """(B, 3, TILE_HEIGHT, TILE_WIDTH) images in [0, 1]: `spectrogram_db` over [max − DB_RANGE, max] dB (max over
    the whole batch, so tiles compare), low frequencies at the bottom, through matplotlib's magma colour map."""
    import matplotlib

    db = spectrogram_db(waveform, sample_rate)
    level = ((db - (db.max() - DB_RANGE)) / DB_RANGE).clamp(0, 1).flip(1)  # (B, F, T), row 0 = highest frequency
    level = torch.nn.functional.interpolate(level[:, None], size=(TILE_HEIGHT, TILE_WIDTH), mode="bilinear",
                                            align_corners=False)[:, 0].clamp(0, 1)
    rgb = matplotlib.colormaps["magma"](level.numpy())[..., :3]  # (B, H, W, 3)
    return torch.from_numpy(rgb).float().permute(0, 3, 1, 2)


def tiles_waveform(waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """(B, channels, samples) -> (channels, B·samples + (B − 1)·gap): the clips in order, `GAP_SECONDS` apart."""
    gap = waveform.new_zeros(waveform.shape[1], int(GAP_SECONDS * sample_rate))
    parts = []
    for i, clip in enumerate(waveform):
        parts += [gap] if i else []
        parts.append(clip)
    return torch.cat(parts, 1)


def save_audio_samples(audio, captions: list[str], scores: list[float] | None, stem: Path,
                       baselines: list[float] | None = None, notes: list[str] | None = None) -> list[Path]:
    """`<stem>.wav` (the clips in tile order, 16-bit PCM) and `<stem>.png` (their captioned spectrograms)."""
    from ..rewards.codec import encode_wav
    from .logging import save_grid

    stem.parent.mkdir(parents=True, exist_ok=True)
    wav, png = stem.with_suffix(".wav"), stem.with_suffix(".png")
    wav.write_bytes(encode_wav(tiles_waveform(audio.waveform.detach().float().cpu(), audio.sample_rate),
                               audio.sample_rate))
    save_grid(spectrogram_images(audio.waveform, audio.sample_rate), captions, scores, png, baselines=baselines,
              notes=notes)
    return [wav, png]
