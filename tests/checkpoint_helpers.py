"""Helpers shared by the checkpoint tests (test_checkpoint_disk.py, test_checkpoint_files.py,
test_checkpoint_signals.py): the tiny-SD3 training command they run, readers of a run's metrics and weights, and a
stand-in actor for calling save_checkpoint directly."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from polyrl.data.prompts import PromptSampler


def train_args(model_dir, prompts, out, steps, *extra, reward: str = "jpeg_compressibility") -> list[str]:
    """`polyrl train` arguments: `steps` deterministic steps of the default recipe's algorithm (DiffusionNFT, with its
    EMA old policy) on the tiny SD3 at 32×32 (3 sampling steps, 2 prompts × 2 images), a checkpoint after every step,
    no evaluation; `extra` overrides come last."""
    return ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3",
            "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=1",
            "trainer.deterministic=true", f"reward={reward}", "rollout.sde_window_size=2",
            "rollout.sde_window_range=[0,1]", *extra]


def metrics(run) -> list[dict]:
    """The rows of a run's metrics.jsonl without the wall-time ones (those differ between equal runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/achieved"))}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def logged_steps(run) -> list[int]:
    """The step of each row of a run's metrics.jsonl."""
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_names(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def weights(ckpt) -> dict[str, torch.Tensor]:
    """The trained weights a checkpoint directory holds."""
    return load_file(str(ckpt / "adapter_model.safetensors"))


def step_weights(run, step: int) -> dict[str, torch.Tensor]:
    """The trained weights of a run's checkpoint of `step`."""
    return weights(run / "checkpoints" / f"step_{step:06d}")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def one_prompt_sampler() -> PromptSampler:
    return PromptSampler([{"prompt": "a"}], 0)


class FakeActor:
    """What save_checkpoint needs of an actor: parameters after one AdamW step and `save_weights`, which raises
    `fail` after the adapter file is written; `old`: an old-policy copy is saved too."""

    def __init__(self, n: int = 4, fail: BaseException | None = None, old: bool = False):
        self.w = torch.nn.Parameter(torch.arange(float(n)))
        self.params = [self.w]
        self.old_params = [self.w.detach().clone()] if old else None
        self.optimizer = torch.optim.AdamW(self.params, lr=0.1)
        self.w.grad = torch.ones(n)
        self.optimizer.step()
        self.fail = fail

    def save_weights(self, directory):
        directory.mkdir(parents=True, exist_ok=True)
        save_file({"transformer.w": self.w.detach().clone()}, str(directory / "adapter_model.safetensors"))
        if self.old_params is not None:
            save_file({"transformer.w": self.old_params[0]}, str(directory / "old_weights.safetensors"))
        if self.fail is not None:
            raise self.fail
        (directory / "weights.json").write_text("{}")
