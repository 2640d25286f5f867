"""Run outputs a person looks at: metrics.jsonl, TensorBoard / W&B / MLflow scalars, sample grids (PNG) and grid
videos (mp4), the reward curve."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..errors import UserError
from ..run_files import read_metrics
from .disk import DiskFull, is_disk_full

LOGGERS = ("tensorboard", "wandb", "mlflow")


class MetricsLogger:
    """One JSON object per step in `metrics.jsonl`, plus the scalars to each logger of `loggers`: `tensorboard`
    (run_dir/tensorboard), `wandb` (Weights & Biases; settings from its WANDB_* environment variables, files
    under run_dir), `mlflow` (settings from MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME). wandb and mlflow are
    imported only when listed; a logger that fails while the run goes on is reported once and dropped, except on
    a full disk: metrics.jsonl and the loggers' files are the run's record, so a write that finds the disk full
    raises DiskFull (its `last` checkpoint is the trainer's to fill in)."""

    def __init__(self, run_dir: Path, loggers=("tensorboard",), name: str = "polyrl", config: dict | None = None,
                 warn=None, resumed_at: int | None = None):
        """`resumed_at`: the step a resumed run continues from (0 when it had no checkpoint): every later step the
        stopped run logged is dropped (`truncate_after`; TensorBoard purges its events), so each step is logged
        once. From 0 the run starts over, its step-0 evaluation included: everything logged is dropped."""
        if resumed_at == 0:
            resumed_at = -1
        self.path, self.run_dir = run_dir / "metrics.jsonl", run_dir
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr))
        self.disk_full = False  # a full disk was reported: closing then says nothing more about it
        self.sinks: dict[str, object] = {}
        self.resume_note = self.truncate_after(resumed_at) if resumed_at is not None else None
        for logger in dict.fromkeys(loggers):
            if logger not in SINKS:
                raise UserError(f"trainer.loggers: unknown logger {logger!r}; allowed: {', '.join(LOGGERS)}")
            try:
                self.sinks[logger] = SINKS[logger](run_dir, name, config or {}, resumed_at)
            except ImportError as e:
                self.close()
                raise UserError(f"trainer.loggers={logger} needs the {logger} package ({e}); pip install {logger}") from None

    def truncate_after(self, step: int) -> str | None:
        """On resume: keep the lines up to the checkpoint's step, so the log matches an uninterrupted run; a torn
        last line is dropped (returned: a note saying so)."""
        rows, note = read_metrics(self.path)
        if self.path.is_file():
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
            tmp.replace(self.path)
        return note

    def log(self, metrics: dict) -> None:
        line = json.dumps(metrics) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as e:
            if is_disk_full(e):
                self.disk_full = True
                raise DiskFull(self.path, len(line.encode()), None, "metrics log") from e
            raise
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(scalars, metrics["step"])
            except Exception as e:  # a logging service going away must not stop training; a full disk does
                if is_disk_full(e):
                    self.disk_full = True
                    where = self.run_dir / "tensorboard" if name == "tensorboard" else self.run_dir
                    raise DiskFull(where, None, None, f"{name} logs") from e
                self.warn(f"polyrl: warning: logger {name} failed ({type(e).__name__}: {e}); it is dropped for this run")
                del self.sinks[name]

    def history(self) -> list[dict]:
        return read_metrics(self.path)[0]

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
            except Exception as e:
                if not (self.disk_full and is_disk_full(e)):  # a full disk already said is not said again
                    self.warn(f"polyrl: warning: logger {name} did not close cleanly ({type(e).__name__}: {e})")
        self.sinks = {}


def _quiet_tensorboard_disk_full() -> None:
    """TensorBoard writes its events on a thread of its own; on a full disk that thread dies printing a traceback,
    and `flush` raises the same error in the trainer, which reports it (DiskFull). This hook keeps the thread's
    copy quiet; any other exception of any thread is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "polyrl_tensorboard", False):
        return

    def hook(args):
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

        if isinstance(args.thread, _AsyncWriterThread) and is_disk_full(args.exc_value):
            return
        previous(args)

    hook.polyrl_tensorboard = True
    threading.excepthook = hook


class TensorBoardSink:
    def __init__(self, run_dir: Path, name: str, config: dict, resumed_at: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_disk_full()

        # a resumed run hides the stopped run's events after its checkpoint (TensorBoard's purge_step)
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class WandbSink:
    """A W&B run whose id is derived from the run directory, so a resumed run continues the same W&B run
    (W&B ignores steps it has already seen). Offline: WANDB_MODE=offline (files under run_dir/wandb)."""

    def __init__(self, run_dir: Path, name: str, config: dict, resumed_at: int | None = None):
        import wandb

        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", name), name=f"{name}/{run_dir.name}",
                              id=run_id, resume="allow", dir=str(run_dir), config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default: the run's name) of the tracking server or
    store MLFLOW_TRACKING_URI names; its id is kept in run_dir/mlflow_run_id, so a resumed run logs into it.
    Metric keys have "." where metrics.jsonl has "/" (`reward.mean`)."""

    def __init__(self, run_dir: Path, name: str, config: dict, resumed_at: int | None = None):
        import mlflow
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient()
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", name)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(k, v[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        id_file.write_text(self.run_id)

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # "/" -> ".": a file store keeps each metric in a file named by its key, so `ratio_absdev` and
        # `ratio_absdev/first_minibatch` would be a file and a directory of the same name
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "."), v, now, step)
                                                    for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def wrap_text(text: str, width: int, draw: ImageDraw.ImageDraw) -> list[str]:
    """`text` in lines at most `width` pixels wide (a word longer than a line gets a line of its own)."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and draw.textlength(candidate) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return lines + [line] if line or not lines else lines


def tile_caption(caption: str, score: float | None, baseline: float | None) -> str:
    """A tile's full prompt, then its reward and, when known, the reward of the same tile at the first evaluation."""
    if score is None:
        return caption
    return caption + f"\nr={score:.2f}" + (f" (was {baseline:.2f})" if baseline is not None else "")


def grid_image(images: torch.Tensor, captions: list[str], scores: list[float] | None, cols: int = 8,
               scale: int = 2, baselines: list[float] | None = None, notes: list[str] | None = None) -> Image.Image:
    """A grid of (B, 3, H, W) images in [0, 1]; under each tile its whole prompt (wrapped to the tile width),
    its reward `r=` and, with `baselines`, that tile's reward at the first evaluation (`was`), then its `notes`
    (lines of text, each wrapped: the extra scorers' values, a reward's caption extras)."""
    b, _, h, w = images.shape
    cols = min(cols, b)
    tile_w = w * scale
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    texts = []
    for i in range(b):
        lines = wrap_text(captions[i], tile_w - 4, draw)
        score = scores[i] if scores is not None else None
        extra = tile_caption("", score, baselines[i] if baselines is not None else None).strip()
        note = [w for line in (notes[i].splitlines() if notes else []) for w in wrap_text(line, tile_w - 4, draw)]
        texts.append("\n".join(lines + ([extra] if extra else []) + note))
    line_h = 12
    cap_h = max(t.count("\n") + 1 for t in texts) * line_h + 4
    rows = math.ceil(b / cols)
    grid = Image.new("RGB", (cols * tile_w, rows * (h * scale + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    for i in range(b):
        x, y = (i % cols) * tile_w, (i // cols) * (h * scale + cap_h)
        grid.paste(Image.fromarray(arr[i]).resize((tile_w, h * scale), Image.NEAREST), (x, y))
        draw.multiline_text((x + 2, y + h * scale + 1), texts[i], fill="black", spacing=2)
    return grid


def save_grid(images: torch.Tensor, captions: list[str], scores: list[float] | None, path: Path, cols: int = 8,
              scale: int = 2, baselines: list[float] | None = None, notes: list[str] | None = None) -> None:
    """A captioned PNG grid (see `grid_image`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    grid_image(images, captions, scores, cols, scale, baselines, notes).save(path)


def save_video_grid(video: torch.Tensor, captions: list[str], scores: list[float] | None, path: Path, fps: float,
                    cols: int = 8, scale: int = 2, baselines: list[float] | None = None, audio=None,
                    notes: list[str] | None = None) -> None:
    """A captioned grid video (mp4) of (B, T, 3, H, W) clips in [0, 1]: frame t of every clip side by side. With
    `audio` (a `media.Audio` of the same B clips) the mp4 holds one AAC track per tile, in tile order, titled
    "tile i: <caption>" (a player plays tile 1's and can switch tracks)."""
    import numpy as np

    from ..rewards.codec import encode_mp4

    frames = np.stack([np.asarray(grid_image(video[:, t], captions, scores, cols, scale, baselines, notes))
                       for t in range(video.shape[1])])
    path.parent.mkdir(parents=True, exist_ok=True)
    sound = {} if audio is None else {
        "audio": audio.waveform.detach().float().cpu().numpy(), "sample_rate": int(audio.sample_rate),
        "audio_titles": [f"tile {i + 1}: {c}" for i, c in enumerate(captions)]}
    path.write_bytes(encode_mp4(frames, fps, **sound))


def pick_tiles(keys: list[str], rewards: torch.Tensor, k: int) -> list[int]:
    """k sample indices whose rewards sit at evenly spaced ranks from the lowest to the highest, one sample per
    distinct prompt (`keys`) while there are enough: a grid that spans hard and easy prompts, hardest first."""
    first = list({key: i for i, key in reversed(list(enumerate(keys)))}.values())
    pool = sorted(first) if len(first) >= k else list(range(len(keys)))
    order = sorted(pool, key=lambda i: (float(rewards[i]), i))
    if k >= len(order):
        return order
    if k == 1:
        return [order[len(order) // 2]]
    return [order[round(j * (len(order) - 1) / (k - 1))] for j in range(k)]


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
    if train or evals:  # an offline-pairs run logs no reward: an empty legend only warns
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
