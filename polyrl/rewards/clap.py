"""`clap`: cosine similarity between the CLAP embeddings of a waveform and of its prompt (text–audio agreement).

Any local transformers `ClapModel` checkpoint (laion/clap-htsat-unfused, laion/larger_clap_music_and_speech, ...)
with its tokenizer and `ClapFeatureExtractor` (from the same directory, or `processor_path`). The audio is mixed to
mono, resampled to the extractor's rate (polyphase, `scipy.signal.resample_poly`) and cut into consecutive windows of
the extractor's `max_length_s` (10 s): each window is featurised with `truncation="rand_trunc"` (a window is never
longer than the maximum, so the extractor's random crop never runs: the score is deterministic; a shorter one is
repeat-padded as the extractor does), and the score is the mean over windows of

    cos(a_w, t) = a_w·t / (‖a_w‖‖t‖),  a_w = get_audio_features(window w), t = get_text_features(prompt).

A final part shorter than half a window is left out when the clip has at least one whole window.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Audio, RewardOutput, check_batch, register_reward, resolve_device, resolve_dtype
from .clip_score import _pooled, local_dir


def resample(waveform: np.ndarray, rate: int, target: int) -> np.ndarray:
    """(..., samples) at `rate` Hz -> at `target` Hz by polyphase filtering (up/down = target/rate in lowest terms)."""
    if rate == target:
        return waveform
    from scipy.signal import resample_poly

    g = math.gcd(int(rate), int(target))
    return resample_poly(waveform, int(target) // g, int(rate) // g, axis=-1)


def audio_windows(mono: np.ndarray, window: int) -> list[np.ndarray]:
    """Consecutive `window`-sample windows of a 1-D clip; the final part is kept when it is at least half a window
    or the clip is shorter than one window."""
    parts = [mono[i : i + window] for i in range(0, max(len(mono), 1), window)]
    if len(parts) > 1 and len(parts[-1]) < window / 2:
        parts = parts[:-1]
    return parts


@register_reward("clap")
class ClapScore:
    """Score = mean over the clip's windows of cos(CLAP audio embedding, CLAP prompt embedding), in [−1, 1]."""

    media = ("audio",)

    def __init__(self, path: str, processor_path: str | None = None, device: str = "auto", dtype: str = "float32",
                 batch_size: int = 16):
        from transformers import AutoTokenizer, ClapFeatureExtractor, ClapModel

        path = local_dir(path, "reward.path (a CLAP model)")
        processor_path = local_dir(processor_path or path, "reward.processor_path (CLAP tokenizer + feature extractor)")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model = ClapModel.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
        self.features = ClapFeatureExtractor.from_pretrained(processor_path)
        self.batch_size = int(batch_size)

    def windows(self, audio: Audio) -> tuple[list[np.ndarray], list[int]]:
        """Every clip's windows at the extractor's rate, and which clip each window belongs to."""
        fe = self.features
        mono = resample(audio.waveform.detach().to("cpu", torch.float64).mean(1).numpy(), audio.sample_rate,
                        fe.sampling_rate)
        out, owner = [], []
        for i, clip in enumerate(mono):
            parts = audio_windows(clip, int(fe.nb_max_samples))
            out += parts
            owner += [i] * len(parts)
        return out, owner

    @torch.no_grad()
    def audio_embeds(self, windows: list[np.ndarray]) -> torch.Tensor:
        """(W, D) float32, L2-normalised, one per window (in batches of `batch_size`)."""
        embeds = []
        for i in range(0, len(windows), self.batch_size):
            feats = self.features(windows[i : i + self.batch_size], sampling_rate=self.features.sampling_rate,
                                  truncation="rand_trunc", return_tensors="pt")
            out = self.model.get_audio_features(input_features=feats["input_features"].to(self.device, self.dtype),
                                                is_longer=feats.get("is_longer"))
            embeds.append(torch.nn.functional.normalize(_pooled(out).float(), dim=-1))
        return torch.cat(embeds)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """(B, D) float32, L2-normalised."""
        t = self.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt")
        out = self.model.get_text_features(input_ids=t["input_ids"].to(self.device),
                                           attention_mask=t["attention_mask"].to(self.device))
        return torch.nn.functional.normalize(_pooled(out).float(), dim=-1)

    def __call__(self, audio, prompts, metadata=None) -> RewardOutput:
        if not isinstance(audio, Audio):
            raise ValueError(f"reward clap scores audio (an Audio batch), got {type(audio).__name__}")
        check_batch("clap", len(audio), prompts, metadata)
        windows, owner = self.windows(audio)
        per_window = (self.audio_embeds(windows) * self.text_embeds(prompts)[owner]).sum(-1).cpu()
        owner_t = torch.tensor(owner)
        scores = torch.zeros(len(audio)).index_add_(0, owner_t, per_window)
        counts = torch.zeros(len(audio)).index_add_(0, owner_t, torch.ones(len(owner)))
        return RewardOutput(scores / counts, {"clap_windows": counts.tolist()})
