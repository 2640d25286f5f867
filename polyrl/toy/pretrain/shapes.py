"""The toy image model (`polyrl pretrain-toy --task shapes`, the default; `polyrl/assets/toy_shapes`): coloured
shapes, an SD3-layout text-to-image model. Two phases on the real diffusers/transformers classes (see
`polyrl.models.tiny`): a small AutoencoderKL learns to reconstruct renders, then the SD3 transformer and its CLIP text
encoder learn rectified flow on the frozen VAE's latents (logit-normal σ, 10% empty-prompt dropout so CFG works). The
result is a diffusers directory that the `sd3` adapter loads like any real checkpoint."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ...models.tiny import TinySD3Spec, build_tiny_sd3, fill_clip_g_slot
from .. import motion_task
from .. import shapes_task as task
from .loops import sd3_flow_calls, train_flow, train_vae


def toy_spec() -> TinySD3Spec:
    words = sorted({w for s in task.all_specs() for w in s.text().split()})
    return TinySD3Spec(
        words=words, text_encoders=("clip_l",), clip_hidden=64, clip_layers=2, clip_l_proj=64, clip_max_length=16,
        num_layers=6, heads=4, head_dim=32, latent_channels=4, patch_size=2, image_size=64,
        vae_channels=(8, 16, 32), vae_layers=1, vae_norm_groups=8, vae_mid_attention=False, shift=1.0,
    )


def _sample_specs(rng: random.Random, n: int, specs: list) -> list:
    singles = [s for s in specs if s.relation is None]
    return [rng.choice(singles) if rng.random() < 0.25 else rng.choice(specs) for _ in range(n)]


def _images(specs, rng: random.Random, size: int) -> torch.Tensor:
    arr = np.stack([task.to_array(task.render(s, size, rng)) for s in specs])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0


def pretrain_toy(
    out: str | Path, vae_steps: int = 1500, steps: int = 3000, num_images: int = 16000, batch: int = 64,
    lr: float = 5e-4, seed: int = 0, prompts_dir: str | Path | None = None, device: str = "cpu",
) -> Path:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    spec = toy_spec()
    pipe = build_tiny_sd3(spec, seed).to(device)
    specs = task.all_specs()
    t0 = time.time()

    # Phase 1: VAE reconstruction.
    vae = pipe.vae
    train_vae(vae, lambda: (_images(_sample_specs(rng, 32, specs), rng, spec.image_size) * 2 - 1).to(device), vae_steps)
    check = _sample_specs(rng, 64, specs)
    with torch.no_grad():
        x = (_images(check, rng, spec.image_size) * 2 - 1).to(device)
        recon = (vae.decode(vae.encode(x).latent_dist.mean).sample / 2 + 0.5).cpu()
    from ...rewards.shapes import ShapesReward

    score = ShapesReward()(recon.clamp(0, 1), [c.text() for c in check], [{} for _ in check]).scores.mean().item()
    tqdm.write(f"vae: shapes reward of reconstructions {score:.3f} (renders score ~1.0)")

    # Cache a dataset of latents (renders are cheap, encoding is not).
    data_specs = _sample_specs(rng, num_images, specs)
    with torch.no_grad():
        lat = torch.cat([
            vae.encode((_images(data_specs[i : i + 256], rng, spec.image_size) * 2 - 1).to(device)).latent_dist.mean
            for i in range(0, num_images, 256)
        ])
    shift, scale = lat.mean().item(), 1.0 / lat.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    lat = (lat - shift) * scale
    prompts = [s.text() for s in data_specs]

    # Phase 2: rectified flow on the transformer + text encoder.
    train_flow([pipe.transformer, pipe.text_encoder], lat, prompts, *sd3_flow_calls(pipe), steps, batch, lr, rng)
    out = Path(out)
    fill_clip_g_slot(pipe)  # so that plain StableDiffusion3Pipeline.from_pretrained loads it (models/tiny.py)
    pipe.to("cpu").save_pretrained(str(out))
    (out / "pretrain.json").write_text(json.dumps({
        "vae_steps": vae_steps, "steps": steps, "num_images": num_images, "batch": batch, "lr": lr, "seed": seed,
        "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "device": str(device),
    }, indent=2))
    if prompts_dir is not None:
        write_prompt_files(prompts_dir)
    return out


def write_prompt_files(prompts_dir: str | Path, seed: int = 0, task_name: str = "shapes") -> None:
    """The RL prompt split of a toy task: `<task>_train.jsonl` for training, `<task>_heldout.jsonl` for evaluation
    only (`task_name`: shapes | motion)."""
    prompts_dir = Path(prompts_dir)
    prompts_dir.mkdir(parents=True, exist_ok=True)
    module = {"shapes": task, "motion": motion_task}[task_name]
    train, heldout = module.split_specs(seed)
    for name, rows in ((f"{task_name}_train.jsonl", module.make_prompts(train)),
                       (f"{task_name}_heldout.jsonl", module.make_prompts(heldout))):
        with open(prompts_dir / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def evaluate_toy(path: str | Path, prompts_file: str | Path, n: int = 64, num_steps: int = 10, device: str = "cpu",
                 seed: int = 1234) -> float:
    """Mean `shapes` reward of ODE samples (fixed seeds) on the first n prompts of `prompts_file`."""
    from types import SimpleNamespace

    from ...data.prompts import load_prompts, split_row
    from ...latents import MediaShape
    from ...models.base import Guidance
    from ...models.sd3 import SD3Policy
    from ...rewards.shapes import ShapesReward
    from ...sampling.diffusion import SamplingPlan, draw_noise, rollout

    adapter = SD3Policy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=16), torch.device(device))
    rows = load_prompts(prompts_file)
    prompts, meta = zip(*(split_row(rows[i % len(rows)]) for i in range(n)), strict=False)
    plan = SamplingPlan(num_steps=num_steps, shape=MediaShape(64, 64), guidance=Guidance(1.0), noise_level=0.0,
                        batch_size=64)
    groups = torch.arange(n)
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(seed))
    batch = rollout(adapter, list(prompts), list(meta), groups, plan, noise)
    return ShapesReward()(batch.media["images"], batch.prompts, batch.metadata).scores.mean().item()
