"""A model-free audio reward for scripts/gpu_matrix.py (`--import scripts/matrix_rewards.py reward=audio_energy`):
the matrix checks that a recipe runs end to end, and the audio recipes' own reward (CLAP) needs a checkpoint that
a random-weight matrix does not have. Score: the waveform's RMS level in dB, mean over channels."""

from __future__ import annotations

import torch

from polyrl.rewards.base import RewardOutput, register_reward


@register_reward("audio_energy")
class AudioEnergy:
    media = ("audio",)

    def __call__(self, media, prompts, metadata) -> RewardOutput:
        wave = media.waveform.float()  # (B, channels, samples) in [-1, 1]
        rms = wave.pow(2).mean(dim=(1, 2)).clamp(min=1e-12).sqrt()
        return RewardOutput((20 * torch.log10(rms)).cpu(), {})
