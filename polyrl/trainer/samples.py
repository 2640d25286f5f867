"""Held-out samples as files a person opens: media grids (images, video, audio) and every sample as a JSON line."""

from __future__ import annotations

import json
from pathlib import Path

from ..batch import Rollout
from ..models.base import prompt_text
from ..rewards.base import caption_texts
from .audio_samples import save_audio_samples
from .logging import save_grid, save_video_grid


def save_samples(batch, stem: Path, fps: float = 16.0, baselines: list[float] | None = None) -> list[Path]:
    """A batch's decoded media as files a person opens: `<stem>.png` for images; for video `<stem>.mp4` (with one
    sound track per tile when the model decodes audio too, e.g. LTX-2) and a PNG grid of each clip's middle frame.
    Captions are the prompts and rewards (and `baselines`, see `grid_image`), then the caption extras of
    `batch.reward_extras` (`caption_texts`: what a reward says about the sample, the extra scorers' values)."""
    captions = [prompt_text(p) for p in batch.prompts]
    scores = batch.rewards.tolist() if batch.rewards is not None else None
    notes = caption_texts(getattr(batch, "reward_extras", None) or {}, len(captions))
    media, written = batch.media or {}, []
    if "images" in media:
        written.append(stem.with_suffix(".png"))
        save_grid(media["images"], captions, scores, written[-1], baselines=baselines, notes=notes)
    if "video" in media:
        video = media["video"]
        written.append(stem.with_suffix(".mp4"))
        save_video_grid(video, captions, scores, written[-1], fps, baselines=baselines, audio=media.get("audio"),
                        notes=notes)
        written.append(stem.with_suffix(".png"))
        save_grid(video[:, video.shape[1] // 2], captions, scores, written[-1], baselines=baselines, notes=notes)
    if "audio" in media and "video" not in media:  # audio-only models: `<stem>.wav` + spectrogram `<stem>.png`
        written += save_audio_samples(media["audio"], captions, scores, stem, baselines, notes)
    return written


def has_media_files(batch: Rollout) -> bool:
    """Whether `save_samples` writes anything for the batch (its media are not text alone)."""
    return bool(set(batch.media or {}) & {"images", "video", "audio"})


def save_text_samples(batch: Rollout, path: Path) -> Path:
    """Every sample as a JSON line {prompt, response (a text policy's), reward, answer (when the data has one),
    caption (its caption extras, when it has any: see `save_samples`)}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = (batch.media or {}).get("text", [None] * len(batch))
    notes = caption_texts(batch.reward_extras or {}, len(batch))
    with path.open("w") as f:
        for i, (prompt, text) in enumerate(zip(batch.prompts, texts, strict=True)):
            row = {"prompt": prompt_text(prompt), **({"response": text} if text is not None else {}),
                   "reward": float(batch.rewards[i]), **{k: v for k, v in batch.metadata[i].items() if k == "answer"},
                   **({"caption": notes[i]} if notes[i] else {})}
            f.write(json.dumps(row) + "\n")
    return path
