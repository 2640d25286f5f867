"""What `polyrl eval` samples and how (engine.py runs it): the config of what is evaluated, the deterministic
sampling plan, each sample's own seeded noise (so the checkpoint and its base, a resumed or re-chunked evaluation,
draw the same noise for it), the models (a checkpoint and its base), and the scoring of a chunk of samples."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

USAGE = ("usage: polyrl eval checkpoint=<run>/checkpoints/step_N | model.path=DIR  data.path=FILE "
         "[eval.scorers=[NAME,...]] [eval.compare_base=true] [eval.samples_per_prompt=K] [eval.output_dir=DIR] "
         "[scorer.NAME.KEY=VALUE ...] [overrides...]")


@dataclass
class EvalOptions:
    scorers: list | None = None  # None: the run's reward
    samples_per_prompt: int = 1
    seed: int = 0
    compare_base: bool = False
    output_dir: str | None = None
    format: str | None = None  # a data/benchmarks.py format; None: detected from the file
    noise_level: float = 0.0  # 0: the deterministic ODE sampler
    resamples: int = 1000  # bootstrap resamples of every ci95
    grid: int = 8  # samples in each of the gains / losses grids (0: none)
    chunk_prompts: int = 0  # prompts sampled per chunk; 0: rollout.batch_size // samples_per_prompt
    max_prompts: int = 0  # 0: every prompt of the file
    progress: bool = True
    extra: dict = field(default_factory=dict)  # not a key: scorer.<name>.<key> overrides land here

def load_eval_config(checkpoint: Path | None, overrides: list[str]):
    """The config: the checkpoint's run config with the overrides (as `polyrl sample`), or, for a base model, the
    composed config (`recipe=`, `model=` ... as `polyrl train`)."""
    from omegaconf import OmegaConf

    from ..config import load_config, validate

    # the evaluation samples every step alike (eval_plan): the training SDE window is not used, and a smaller
    # rollout.num_steps must not fail the training config's window checks
    overrides = [*overrides, "rollout.sde_window_size=0"]
    if checkpoint is None:
        if not any(o.startswith("model.path=") for o in overrides):
            raise UserError(f"polyrl eval: checkpoint=DIR or model.path=DIR is required; {USAGE}")
        return load_config(overrides)
    run_cfg = checkpoint.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise UserError(f"polyrl eval: {run_cfg} not found (is {checkpoint} inside a polyrl run directory?)")
    return validate(OmegaConf.merge(OmegaConf.load(run_cfg), OmegaConf.from_dotlist(overrides)))

def eval_plan(r, noise_level: float):
    """The rollout config's sampling plan, made deterministic (noise level 0) or SDE at `noise_level` everywhere,
    with no trained window (every step sampled alike)."""
    from ..latents import MediaShape
    from ..models.base import Guidance
    from ..sampling.diffusion import SamplingPlan

    return SamplingPlan(
        num_steps=r.num_steps, shape=MediaShape(height=r.height, width=r.width, frames=r.num_frames, fps=r.fps),
        guidance=Guidance(r.guidance_scale, r.negative_prompt), noise_level=noise_level, window_size=0,
        batch_size=r.batch_size, step=r.step, log_density=r.log_density, training_graph=False)

def token_eval_plan(r, temperature: float):
    """A token policy's evaluation plan: the run's `rollout.*` keys at `temperature` (0: greedy decoding)."""
    from dataclasses import replace

    from ..sampling.tokens import token_plan_from_config

    return replace(token_plan_from_config(r), temperature=temperature)

def sample_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt_index`: fixed by the prompt's place in the file alone, so a
    resumed or re-chunked evaluation, and the base model, draw the same noise for it."""
    return (seed * 1_000_003 + prompt_index) * 4096 + sample

def draw_samples_noise(adapter, plan, keys: list[tuple[int, int]], seed: int):
    """The noise of samples `keys` ((prompt index, sample) each), one seeded draw per sample, concatenated."""
    from ..sampling.diffusion import RolloutNoise, draw_noise

    shapes = adapter.latent_shapes(plan.shape)
    parts = [draw_noise(shapes, plan, torch.zeros(1, dtype=torch.long),
                        torch.Generator().manual_seed(sample_seed(seed, p, k))) for p, k in keys]
    return RolloutNoise({n: torch.cat([x.initial[n] for x in parts]) for n in shapes},
                        torch.cat([x.starts for x in parts]),
                        {n: torch.cat([x.steps[n] for x in parts], dim=1) for n in shapes})

class Models:
    """The checkpoint's model and, for `compare_base`, its base: the same networks with the LoRA switched off, or
    (a full fine-tune) a second copy loaded from the base directory."""

    def __init__(self, cfg, checkpoint: Path | None, device, compare_base: bool):
        from ..actor.local import load_trained_weights
        from ..models import build_model

        self.trained = build_model(cfg.model, device)
        self.lora = False
        self.base = None
        if checkpoint is not None:
            load_trained_weights(self.trained, checkpoint)
            self.lora = bool(json.loads((checkpoint / "weights.json").read_text()).get("lora"))
            if compare_base and not self.lora:
                self.base = build_model(cfg.model, device)
        for network in self.trained.modules().values():
            network.eval()

    def get(self, which: str):
        """The adapter that samples `which` ("trained" or "base")."""
        if which == "base" and self.base is not None:
            return self.base
        if self.lora:
            from ..actor.local import set_adapters_enabled

            for network in self.trained.modules().values():
                set_adapters_enabled(network, which == "trained")
        return self.trained

def sample_chunk(models: Models, which: str, plan, rows: list[dict], keys: list[tuple[int, int]], seed: int):
    """Decoded samples of `keys` ((prompt index, sample) each) with `which` model: (media, final latents, prompts,
    metadata, group ids: the prompt indices; a chunk holds every sample of its prompts, whole groups for a group
    reward). A token policy's media are its responses ({"text": [...]}) and it has no latents."""
    from ..data.prompts import split_row
    from ..sampling.diffusion import rollout
    from ..sampling.tokens import TokenPlan, draw_uniforms, token_rollout

    adapter = models.get(which)
    prompts, metadata = zip(*(split_row(rows[p]) for p, _ in keys), strict=True)
    group_ids = torch.tensor([p for p, _ in keys])
    with torch.no_grad():
        if isinstance(plan, TokenPlan):
            uniforms = torch.cat([draw_uniforms(1, plan, torch.Generator().manual_seed(sample_seed(seed, p, k)))
                                  for p, k in keys])
            batch = token_rollout(adapter, list(prompts), list(metadata), group_ids, plan, uniforms)
        else:
            batch = rollout(adapter, list(prompts), list(metadata), group_ids, plan,
                            draw_samples_noise(adapter, plan, keys, seed))
    return batch.media, batch.final, list(prompts), list(metadata), batch.group_ids

def score_all(scorers: dict, media, final, prompts, metadata, group_ids) -> dict[str, list[float]]:
    from ..media import primary
    from ..rewards.base import call_reward
    from ..rewards.stage import checked_scores, reward_latents

    out = {}
    with torch.no_grad():
        for name, reward in scorers.items():
            result = call_reward(reward, primary(media), prompts, metadata, latents=reward_latents(final),
                                 group_ids=group_ids)
            out[name] = checked_scores(result, name, len(prompts)).tolist()
    return out
