"""`polyrl pretrain-toy`: train the embedded toy base model on procedurally rendered coloured shapes.

Two phases on the real diffusers/transformers classes (see `polyrl.models.tiny`): a small AutoencoderKL learns
to reconstruct renders, then the SD3 transformer and its CLIP text encoder learn rectified flow on the frozen
VAE's latents (logit-normal σ, 10% empty-prompt dropout so CFG works). The result is a diffusers directory that
the `sd3` adapter loads like any real checkpoint.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.sd3 import encode_sd3_prompts
from ..models.tiny import TinySD3Spec, build_tiny_sd3
from ..toy import shapes_task as task


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

    # Phase 1: VAE reconstruction (tiny KL weight: the latents only need to be smooth enough to diffuse).
    vae = pipe.vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=2e-3)
    for _ in (bar := tqdm(range(vae_steps), desc="vae")):
        x = (_images(_sample_specs(rng, 32, specs), rng, spec.image_size) * 2 - 1).to(device)
        post = vae.encode(x).latent_dist
        recon = vae.decode(post.sample()).sample
        loss = F.mse_loss(recon, x) + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(mse=f"{loss.item():.4f}")
    vae.eval().requires_grad_(False)
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
    tr, te = pipe.transformer.train(), pipe.text_encoder.train()
    params = list(tr.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 200) * max(0.1, 1 - i / steps))
    encoders = [pipe.text_encoder, None, None]
    tokenizers = [pipe.tokenizer, None, None]
    for _ in (bar := tqdm(range(steps), desc="flow")):
        idx = torch.randint(0, num_images, (batch,))
        x0 = lat[idx.to(lat.device)]
        batch_prompts = ["" if rng.random() < 0.1 else prompts[i] for i in idx.tolist()]
        cond = encode_sd3_prompts(encoders, tokenizers, batch_prompts, tr.config, 0)
        sigma = torch.sigmoid(torch.randn(batch, device=x0.device))
        noise = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        v = tr(xt, cond["prompt_embeds"], cond["pooled"], sigma * 1000, return_dict=False)[0]
        loss = F.mse_loss(v, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    tr.eval()
    te.eval()
    out = Path(out)
    pipe.to("cpu").save_pretrained(str(out))
    (out / "pretrain.json").write_text(json.dumps({
        "vae_steps": vae_steps, "steps": steps, "num_images": num_images, "batch": batch, "lr": lr, "seed": seed,
        "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "device": str(device),
    }, indent=2))
    if prompts_dir is not None:
        write_prompt_files(prompts_dir)
    return out


def write_prompt_files(prompts_dir: str | Path, seed: int = 0) -> None:
    """The RL prompt split: `shapes_train.jsonl` for training, `shapes_heldout.jsonl` for evaluation only."""
    prompts_dir = Path(prompts_dir)
    prompts_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = task.split_specs(seed)
    for name, rows in (("shapes_train.jsonl", task.make_prompts(train)), ("shapes_heldout.jsonl", task.make_prompts(heldout))):
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
