"""Run outputs a person looks at: metrics.jsonl, TensorBoard, sample grids (PNG) and grid videos (mp4), the
reward curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from PIL import Image, ImageDraw


class MetricsLogger:
    """One JSON object per step in `metrics.jsonl` (plus TensorBoard scalars when enabled)."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines written after the checkpoint, so the log matches an uninterrupted run."""
        if self.path.is_file():
            keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, metrics["step"])
            self.writer.flush()

    def history(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def grid_image(images: torch.Tensor, captions: list[str], scores: list[float] | None, cols: int = 8,
               scale: int = 2) -> Image.Image:
    """A grid of (B, 3, H, W) images in [0, 1]; each tile is captioned with its prompt (wrapped) and score."""
    b, _, h, w = images.shape
    cols = min(cols, b)
    tile_w, cap_h = w * scale, 34
    rows = math.ceil(b / cols)
    grid = Image.new("RGB", (cols * tile_w, rows * (h * scale + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    for i in range(b):
        x, y = (i % cols) * tile_w, (i // cols) * (h * scale + cap_h)
        grid.paste(Image.fromarray(arr[i]).resize((tile_w, h * scale), Image.NEAREST), (x, y))
        words, lines, line = captions[i].split(), [], ""
        for word in words:
            if len(line) + len(word) + 1 > tile_w // 6:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}".strip()
        lines.append(line)
        text = "\n".join(lines[:2] + ([f"r={scores[i]:.2f}"] if scores is not None else []))
        draw.multiline_text((x + 2, y + h * scale + 1), text, fill="black", spacing=0)
    return grid


def save_grid(images: torch.Tensor, captions: list[str], scores: list[float] | None, path: Path, cols: int = 8,
              scale: int = 2) -> None:
    """A captioned PNG grid (see `grid_image`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    grid_image(images, captions, scores, cols, scale).save(path)


def save_video_grid(video: torch.Tensor, captions: list[str], scores: list[float] | None, path: Path, fps: float,
                    cols: int = 8, scale: int = 2) -> None:
    """A captioned grid video (mp4) of (B, T, 3, H, W) clips in [0, 1]: frame t of every clip side by side."""
    import numpy as np

    from ..rewards.codec import encode_mp4

    frames = np.stack([np.asarray(grid_image(video[:, t], captions, scores, cols, scale))
                       for t in range(video.shape[1])])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_mp4(frames, fps))


def save_samples(batch, stem: Path, fps: float = 16.0) -> list[Path]:
    """A batch's decoded media as files a person opens: `<stem>.png` for images; for video `<stem>.mp4` and a PNG
    grid of each clip's middle frame. Captions are the prompts and rewards."""
    from ..models.base import prompt_text

    captions = [prompt_text(p) for p in batch.prompts]
    scores = batch.rewards.tolist() if batch.rewards is not None else None
    media, written = batch.media or {}, []
    if "images" in media:
        written.append(stem.with_suffix(".png"))
        save_grid(media["images"], captions, scores, written[-1])
    if "video" in media:
        video = media["video"]
        written.append(stem.with_suffix(".mp4"))
        save_video_grid(video, captions, scores, written[-1], fps)
        written.append(stem.with_suffix(".png"))
        save_grid(video[:, video.shape[1] // 2], captions, scores, written[-1])
    return written


def plot_reward_curve(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [(m["step"], m["reward/mean"]) for m in history if "reward/mean" in m]
    evals = [(m["step"], m["eval/reward_mean"]) for m in history if "eval/reward_mean" in m]
    if train:
        ax.plot(*zip(*train, strict=False), label="train reward (rollout mean)", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals, strict=False), "o-", label="held-out reward (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
