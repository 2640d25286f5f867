"""`polyrl pretrain-toy`: train the embedded toy base models on procedurally rendered tasks.

`--task shapes` (the default): coloured shapes, an SD3-layout text-to-image model. Two phases on the real
diffusers/transformers classes (see `polyrl.models.tiny`): a small AutoencoderKL learns to reconstruct renders,
then the SD3 transformer and its CLIP text encoder learn rectified flow on the frozen VAE's latents (logit-normal
σ, 10% empty-prompt dropout so CFG works). The result is a diffusers directory that the `sd3` adapter loads like
any real checkpoint.

`--task count` (`pretrain_count.py`): the toy text model, a tiny Qwen3-class causal LM that counts the shapes
named in a scene description; `model=causal_lm` loads it.

`--task rewrite` (`pretrain_rewrite.py`): the toy prompt rewriter, a tiny Qwen3-class causal LM that rewrites
shapes requests (carelessly) for the frozen toy_shapes generator; `recipe=toy_rewriter` trains it through that
generator.

`--task motion`: moving shapes (`polyrl.toy.motion_task`), a Wan2.1-layout text-to-video model trained the same
way (`pretrain_motion`): an AutoencoderKLWan on rendered clips, then the WanTransformer3DModel and its UMT5 encoder
with rectified flow on the frozen VAE's normalised latents; the `wan` adapter loads the result.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..models.tiny import TinySD3Spec, TinyWanSpec, build_tiny_sd3, build_tiny_wan, fill_clip_g_slot
from ..toy import motion_task
from ..toy import shapes_task as task
from .pretrain_loops import sd3_flow_calls, train_flow, train_vae


# ----------------------------------------------------------------------------------------------- shapes (image)
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
    from ..rewards.shapes import ShapesReward

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

    from ..data.prompts import load_prompts, split_row
    from ..latents import MediaShape
    from ..models.base import Guidance
    from ..models.sd3 import SD3Policy
    from ..rewards.shapes import ShapesReward
    from ..sampling.diffusion import SamplingPlan, draw_noise, rollout

    adapter = SD3Policy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=16), torch.device(device))
    rows = load_prompts(prompts_file)
    prompts, meta = zip(*(split_row(rows[i % len(rows)]) for i in range(n)), strict=False)
    plan = SamplingPlan(num_steps=num_steps, shape=MediaShape(64, 64), guidance=Guidance(1.0), noise_level=0.0,
                        batch_size=64)
    groups = torch.arange(n)
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(seed))
    batch = rollout(adapter, list(prompts), list(meta), groups, plan, noise)
    return ShapesReward()(batch.media["images"], batch.prompts, batch.metadata).scores.mean().item()


# ----------------------------------------------------------------------------------------------- motion (video)
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
    from ..rewards.motion import MotionReward

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

    from ..data.prompts import load_prompts, split_row
    from ..latents import MediaShape
    from ..models.base import Guidance
    from ..models.wan import WanPolicy
    from ..rewards.motion import MotionReward
    from ..sampling.diffusion import SamplingPlan, draw_noise, rollout

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


# ----------------------------------------------------------------------------------------------- command line
# Per task: where the model goes and the default (CPU) budget.
DEFAULTS = {
    "shapes": dict(out="toy_shapes", vae_steps=1000, steps=2500, num_images=16000, batch=64),
    "motion": dict(out="toy_motion", vae_steps=400, steps=2000, num_images=4000, batch=32),
    "count": dict(out="toy_count", vae_steps=0, steps=600, num_images=0, batch=64),  # a text model: no VAE, no images
    "text": dict(out="toy_text", vae_steps=300, steps=2000, num_images=8000, batch=32),
    "rewrite": dict(out="toy_rewriter", vae_steps=0, steps=800, num_images=0, batch=64),  # a text model
}


def main(args: list[str]) -> int:
    """`polyrl pretrain-toy [--task shapes|motion|count|text|rewrite] [--device cuda] [--out DIR] ...`"""
    from ..config import ASSETS

    p = argparse.ArgumentParser(prog="polyrl pretrain-toy", description="train an embedded toy base model")
    p.add_argument("--task", choices=tuple(DEFAULTS), default="shapes",
                   help="shapes: the text-to-image default (toy_shapes); motion: the text-to-video one (toy_motion); "
                        "count: the text default, a tiny causal LM (toy_count); text: an SD3-layout model that "
                        "writes the quoted word of a prompt, the base of recipe toy_ocr (toy_text); rewrite: a tiny causal LM "
                        "that rewrites shapes requests for the toy_shapes generator, the base of recipe toy_rewriter "
                        "(toy_rewriter)")
    p.add_argument("--out", default=None, help="model directory (default: polyrl/assets/toy_<task>)")
    p.add_argument("--prompts-dir", default=str(ASSETS / "prompts"))
    p.add_argument("--vae-steps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--num-images", "--num-clips", dest="num_images", type=int, default=None,
                   help="training images (shapes) or clips (motion)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--vae-batch", type=int, default=16, help="motion, text: clips / images per VAE step")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="motion, count, text, rewrite: held-out prompts sampled after training, reward recorded in pretrain.json "
                        "(0: skip; text: default 160, every held-out word)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="text: torch CPU threads (default: torch's)")
    p.add_argument("--init", default=None, help="text: continue training a model it wrote (VAE kept, --steps more)")
    a = p.parse_args(args)
    if a.eval_samples is None:
        a.eval_samples = 160 if a.task == "text" else 64
    d = DEFAULTS[a.task]
    budget = {k: d[k] if getattr(a, k) is None else getattr(a, k) for k in ("vae_steps", "steps", "num_images", "batch")}
    out = a.out or str(ASSETS / d["out"])
    if a.task == "shapes":
        path = pretrain_toy(out, vae_steps=budget["vae_steps"], steps=budget["steps"], num_images=budget["num_images"],
                            batch=budget["batch"], seed=a.seed, prompts_dir=a.prompts_dir, device=a.device)
    elif a.task == "text":
        from .pretrain_text import pretrain_text

        path = pretrain_text(out, vae_steps=budget["vae_steps"], steps=budget["steps"], num_images=budget["num_images"],
                             batch=budget["batch"], seed=a.seed, prompts_dir=a.prompts_dir, device=a.device,
                             eval_samples=a.eval_samples, vae_batch=a.vae_batch, threads=a.threads, init=a.init)
    elif a.task == "rewrite":
        from .pretrain_rewrite import pretrain_rewrite

        path = pretrain_rewrite(out, steps=budget["steps"], batch=budget["batch"], seed=a.seed,
                                prompts_dir=a.prompts_dir, device=a.device, eval_samples=a.eval_samples)
    elif a.task == "count":
        from .pretrain_count import pretrain_count

        path = pretrain_count(out, steps=budget["steps"], batch=budget["batch"], seed=a.seed, prompts_dir=a.prompts_dir,
                              device=a.device, eval_samples=a.eval_samples)
    else:
        path = pretrain_motion(out, vae_steps=budget["vae_steps"], steps=budget["steps"], num_clips=budget["num_images"],
                               batch=budget["batch"], seed=a.seed, prompts_dir=a.prompts_dir, device=a.device,
                               vae_batch=a.vae_batch, eval_samples=a.eval_samples)
    print(f"polyrl: wrote {path}")
    return 0
