"""The toy video model (`polyrl pretrain-toy --task motion`; `polyrl/assets/toy_motion`): moving shapes
(`polyrl.toy.motion_task`), a Wan2.1-layout text-to-video model trained the way the image model is (shapes.py): an
AutoencoderKLWan on rendered clips, then the WanTransformer3DModel and its UMT5 encoder with rectified flow on the
frozen VAE's normalised latents; the `wan` adapter loads the result."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ...models.tiny import TinyWanSpec, build_tiny_wan
from .. import motion_task
from .loops import train_flow, train_vae
from .shapes import write_prompt_files

MOTION_FRAMES = 9  # 4k+1 for the Wan VAE: latent frames 1 + 2
MOTION_SIZE = 48  # at 48 px the shapes detection reads every rendered shape right, also blurred (rewards/motion.py)
MOTION_TEXT_LENGTH = 16  # UMT5 tokens; the longest prompt is 11 words + </s>. recipe toy_motion: model.max_sequence_length
MOTION_SHIFT = 1.0  # flow shift written into the scheduler (WanPolicy samples on wan_sigmas(N, shift))


def motion_spec() -> TinyWanSpec:
    """The toy video model: Wan2.1 layout (z_dim 16, one timestep per sample) at small widths, with a VAE of two
    downsampling stages (4× spatial, 4× temporal, where Wan2.1's has 8× spatial): a 9×48×48 clip is a
    (16, 3, 12, 12) latent, 108 transformer tokens after the 2×2 patch."""
    words = sorted({w for s in motion_task.all_specs() for w in s.text().split()})
    return TinyWanSpec(
        words=words, layout="wan2.1", text_d_model=64, text_layers=2, text_heads=2,
        text_max_length=MOTION_TEXT_LENGTH, num_layers=6, heads=4, head_dim=32, ffn_dim=512, freq_dim=64,
        vae_base_dim=16, vae_dim_mult=(1, 2, 2), vae_res_blocks=1, scheduler="unipc", shift=MOTION_SHIFT,
    )


def _sample_motion_specs(rng: random.Random, n: int, specs: list) -> list:
    """Half one-group prompts, half two-object ones (the grammar alone would give 95% two-object prompts)."""
    singles = [s for s in specs if len(s.groups) == 1]
    pairs = [s for s in specs if len(s.groups) == 2]
    return [rng.choice(singles) if rng.random() < 0.5 else rng.choice(pairs) for _ in range(n)]


def render_clips(specs: list, rng: random.Random, frames: int = MOTION_FRAMES, size: int = MOTION_SIZE) -> torch.Tensor:
    """Rendered clips as uint8 (B, T, H, W, 3)."""
    return torch.from_numpy(np.stack([motion_task.render(s, frames, size, rng) for s in specs]))


def clips_to_vae(clips: torch.Tensor, device) -> torch.Tensor:
    """uint8 (B, T, H, W, 3) -> the VAE's input (B, 3, T, H, W) in [-1, 1]."""
    return clips.to(device).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def encode_wan_prompts(text_encoder, tokenizer, prompts: list[str], max_length: int) -> torch.Tensor:
    """WanPipeline's prompt embedding for a batch (B, max_length, d), with gradients: UMT5 on the cleaned prompt
    padded to `max_length`, the padded positions' states zeroed (what `WanPolicy._encode_one` does per prompt)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokens = tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_length,
                       truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


def latent_statistics(latents: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of (N, C, F, h, w) VAE latents: the VAE config's `latents_mean` / `latents_std`,
    with which the `wan` adapter normalises x = (z − mean) / std."""
    z = latents.transpose(0, 1).reshape(latents.shape[1], -1).double()
    return z.mean(1).tolist(), z.std(1).clamp_min(1e-6).tolist()


def reconstruction_loss(recon: torch.Tensor, x: torch.Tensor, object_weight: float = 4.0) -> torch.Tensor:
    """Σ w·(x̂ − x)² / Σ w with w = 1 + object_weight on pixels that are not background (any channel below 0.8 in
    [−1, 1], i.e. not near-white): objects cover ~5% of a clip, so a plain MSE is met first by a white canvas."""
    w = 1.0 + object_weight * (x.amin(1, keepdim=True) < 0.8).to(x.dtype)
    return (w * (recon - x).square()).sum() / (w.sum() * x.shape[1])


def _mean_tail(values: list[float], k: int = 50) -> float:
    return round(float(np.mean(values[-k:])), 5) if values else float("nan")


def pretrain_motion(
    out: str | Path, vae_steps: int = 400, steps: int = 2000, num_clips: int = 4000, batch: int = 32,
    lr: float = 5e-4, seed: int = 0, prompts_dir: str | Path | None = None, device: str = "cpu",
    vae_batch: int = 16, vae_lr: float = 2e-3, eval_samples: int = 64, progress: bool = True,
) -> Path:
    """Train the toy video model (`motion_spec`) into `out` and write `pretrain.json` beside it.

    Phase 1: the AutoencoderKLWan reconstructs rendered clips (`reconstruction_loss`, object pixels weighted 5×,
    + 1e-6·KL); its latents' per-channel mean and std become `latents_mean` / `latents_std` in its config.
    Phase 2: the transformer and UMT5 learn rectified flow on the frozen VAE's normalised latents x0 as `WanPolicy`
    samples it: x_σ = (1 − σ)·x0 + σ·ε, target velocity ε − x0, timestep σ·1000, σ = sigmoid(n) with
    n ~ N(0, 1), 10% of the prompts replaced by "" (so CFG works). Clips come from one rendered pool of `num_clips` (used by both phases). `eval_samples` > 0:
    the held-out `motion` reward of ODE samples (10 steps) from the saved model, recorded in pretrain.json.
    """
    from ...rewards.motion import MotionReward

    t_start = time.time()
    timings: dict[str, float] = {}
    if str(device).startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # tiny widths: fp32 accuracy is not the limit here
    torch.manual_seed(seed)
    rng = random.Random(seed)
    spec = motion_spec()
    pipe = build_tiny_wan(spec, seed)
    vae, tr, te = pipe.vae.to(device), pipe.transformer.to(device), pipe.text_encoder.to(device)
    train_specs, _ = motion_task.split_specs(0)  # held-out prompts are never seen (the RL split)
    t0 = time.time()
    pool_specs = _sample_motion_specs(rng, num_clips, train_specs)
    pool = render_clips(pool_specs, rng).to(device)  # uint8, 9·48·48·3 bytes a clip
    prompts = [s.text() for s in pool_specs]
    timings["render"] = time.time() - t0

    # Phase 1: VAE reconstruction.
    t0 = time.time()
    vae_losses = train_vae(
        vae, lambda: clips_to_vae(pool[torch.randint(0, num_clips, (vae_batch,), device=pool.device)], device),
        vae_steps, vae_lr, reconstruction_loss, progress)
    timings["vae"] = time.time() - t0

    # Latents of the whole pool, their statistics into the VAE config, and a reconstruction check.
    t0 = time.time()
    with torch.no_grad():
        lat = torch.cat([vae.encode(clips_to_vae(pool[i : i + 64], device)).latent_dist.mean
                         for i in range(0, num_clips, 64)])
        check = list(range(min(64, num_clips)))
        recon = vae.decode(lat[check]).sample.clamp(-1, 1).permute(0, 2, 1, 3, 4).cpu() / 2 + 0.5
    latents_mean, latents_std = latent_statistics(lat)
    vae.register_to_config(latents_mean=latents_mean, latents_std=latents_std)
    mean = torch.tensor(latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
    lat = (lat - mean) / std
    reward = MotionReward()
    recon_score = reward(recon, [prompts[i] for i in check]).scores.mean().item()
    timings["encode"] = time.time() - t0
    tqdm.write(f"vae: motion reward of reconstructions {recon_score:.3f} (renders score ~1.0)")

    # Phase 2: rectified flow on the transformer + text encoder.
    t0 = time.time()
    flow_losses = train_flow(
        [tr, te], lat, prompts, lambda p: encode_wan_prompts(te, pipe.tokenizer, p, MOTION_TEXT_LENGTH),
        lambda x, timestep, embeds: tr(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                                       return_dict=False)[0],
        steps, batch, lr, rng, progress)
    timings["flow"] = time.time() - t0

    out = Path(out)
    pipe.to("cpu").save_pretrained(str(out))
    if prompts_dir is not None:
        write_prompt_files(prompts_dir, task_name="motion")
    heldout_reward = None
    if eval_samples > 0:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            write_prompt_files(tmp, task_name="motion")
            heldout_reward = evaluate_motion(out, Path(tmp) / "motion_heldout.jsonl", n=eval_samples, device=device)
        timings["eval"] = time.time() - t0
        tqdm.write(f"motion reward of ODE samples on {eval_samples} held-out prompts: {heldout_reward:.3f}")
    timings["total"] = time.time() - t_start
    curve_every = max(1, steps // 10)  # flow_curve: the loss over the last 50 steps at each tenth of the run
    (out / "pretrain.json").write_text(json.dumps({
        "task": "motion", "frames": MOTION_FRAMES, "size": MOTION_SIZE, "vae_steps": vae_steps, "vae_batch": vae_batch,
        "vae_lr": vae_lr, "vae_object_weight": 4.0, "steps": steps, "num_clips": num_clips, "batch": batch, "lr": lr, "seed": seed,
        "shift": MOTION_SHIFT, "text_length": MOTION_TEXT_LENGTH,
        "losses": {
            "vae_final": _mean_tail(vae_losses), "flow_final": _mean_tail(flow_losses),
            "flow_curve": [_mean_tail(flow_losses[: i + curve_every]) for i in range(0, steps, curve_every)],
        },
        "vae_reconstruction_reward": round(recon_score, 4),
        "heldout_reward": None if heldout_reward is None else round(heldout_reward, 4),
        "eval_samples": eval_samples,
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "torch": torch.__version__, "device": str(device),
    }, indent=2))
    return out


def evaluate_motion(path: str | Path, prompts_file: str | Path, n: int = 64, num_steps: int = 10, device: str = "cpu",
                    seed: int = 1234) -> float:
    """Mean `motion` reward of ODE samples (fixed seeds, the `wan` adapter) on the first n prompts of `prompts_file`."""
    from types import SimpleNamespace

    from ...data.prompts import load_prompts, split_row
    from ...latents import MediaShape
    from ...models.base import Guidance
    from ...models.wan import WanPolicy
    from ...rewards.motion import MotionReward
    from ...sampling.diffusion import SamplingPlan, draw_noise, rollout

    adapter = WanPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=MOTION_TEXT_LENGTH),
                        torch.device(device))
    rows = load_prompts(prompts_file)
    prompts, meta = zip(*(split_row(rows[i % len(rows)]) for i in range(n)), strict=True)
    plan = SamplingPlan(num_steps=num_steps, shape=MediaShape(MOTION_SIZE, MOTION_SIZE, frames=MOTION_FRAMES),
                        guidance=Guidance(1.0), noise_level=0.0, batch_size=64)
    groups = torch.arange(n)
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(seed))
    batch = rollout(adapter, list(prompts), list(meta), groups, plan, noise)
    return MotionReward()(batch.media["video"], batch.prompts, batch.metadata).scores.mean().item()
