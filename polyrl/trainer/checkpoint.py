"""Checkpoints: trainable weights (safetensors: LoRA adapter or full transformer) + trainer state.

Layout: `<run>/checkpoints/step_000010/{adapter_model.safetensors | transformer.safetensors, weights.json,
trainer_state.pt}`. The trainer state holds the optimizer, the prompt sampler position and the step; every other
random draw is a function of (seed, step), so a resumed run continues exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "trainer_state.pt").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def save_checkpoint(directory: Path, actor, sampler, step: int, extra: dict) -> None:
    tmp = directory.with_name(directory.name + ".tmp")
    actor.save_weights(tmp)
    torch.save({
        "step": step, "optimizer": actor.optimizer.state_dict(), "sampler": sampler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        **extra,
    }, tmp / "trainer_state.pt")
    if directory.exists():
        import shutil

        shutil.rmtree(directory)
    tmp.rename(directory)  # a checkpoint directory exists only once it is complete


def load_checkpoint(directory: Path, actor, sampler) -> dict:
    state = torch.load(directory / "trainer_state.pt", weights_only=False)
    actor.load_weights(directory)
    actor.optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return state
