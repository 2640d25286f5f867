"""`polyrl pretrain-toy --task text`: the toy OCR model, an SD3-layout text-to-image model that writes a word.

The task is `polyrl.toy.text_task`: `a sign that says "HELLO"` -> a 32x128 sign with HELLO on it. The model is the
real SD3 stack at toy widths (`polyrl.models.tiny`), trained in two phases like `toy_shapes`:
1. a small AutoencoderKL (4x down, 4 latent channels) reconstructs rendered signs (+ 1e-6 KL);
2. the SD3 transformer and its CLIP text encoder learn rectified flow on the frozen VAE's latents:
   x_σ = (1 − σ)·x0 + σ·ε, target velocity ε − x0, σ = sigmoid(n), n ~ N(0, 1), 10% empty prompts (so CFG works).
The CLIP tokenizer spells the quoted word out letter by letter (`TinySD3Spec.letters`), so a held-out word is made
of known tokens; the model only ever sees training words (`text_task.split_words`). It is trained briefly, so it
writes held-out words legibly but often wrongly: the base for `recipe=toy_ocr` (Flow-GRPO against `reward=ocr`).
`pretrain.json` records the budget, the losses, the OCR accuracy of the VAE's reconstructions and the held-out
OCR accuracy of ODE samples (`evaluate_text`).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

from ...models.tiny import TinySD3Spec, build_tiny_sd3, fill_clip_g_slot
from .. import text_task
from .loops import sd3_flow_calls, train_flow, train_vae

TEXT_LENGTH = 16  # CLIP tokens: <bos>, four words, the quoted word of at most 6 letters, <eos> = 14
OCR = {"name": "ocr", "detect": False, "threads": 1}  # recognition only: a sign is one line of text


def text_spec() -> TinySD3Spec:
    """The toy OCR model: 32x128 images, 8x32x4 latents, 2x2 patches -> 64 image tokens + 16 text tokens."""
    return TinySD3Spec(
        words=text_task.template_words() + ['"'], letters=text_task.TEXT_LETTERS, text_encoders=("clip_l",),
        clip_hidden=64, clip_layers=2, clip_l_proj=64, clip_max_length=TEXT_LENGTH,
        num_layers=5, heads=3, head_dim=32, latent_channels=4, patch_size=2, image_size=text_task.WIDTH,
        vae_channels=(8, 16, 32), vae_layers=1, vae_norm_groups=8, vae_mid_attention=False, shift=1.0,
    )


def render_batch(words: list[str], rng: random.Random) -> torch.Tensor:
    """Rendered signs as (B, 3, H, W) in [0, 1]."""
    arr = np.stack([text_task.to_array(text_task.render(w, rng)) for w in words])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0


def _mean_tail(values: list[float], k: int = 50) -> float | None:
    return round(float(np.mean(values[-k:])), 5) if values else None


def pretrain_text(
    out: str | Path, vae_steps: int = 300, steps: int = 2000, num_images: int = 8000, batch: int = 32,
    lr: float = 5e-4, seed: int = 0, prompts_dir: str | Path | None = None, device: str = "cpu",
    eval_samples: int = 160, progress: bool = True, vae_batch: int = 16, threads: int | None = None,
    init: str | Path | None = None,
) -> Path:
    """Train the toy OCR model (`text_spec`) into `out` and write `pretrain.json` beside it (module docstring).
    `threads`: torch's CPU threads (on a shared, busy CPU one thread per process is several times faster).
    `init`: continue from a model this function wrote: its VAE (and latent normalisation) is kept, phase 1 is
    skipped, phase 2 runs `steps` more steps with a fresh warm-up and decay; pretrain.json records both runs."""
    from ...rewards import build_reward

    if threads is not None:
        torch.set_num_threads(threads)
    t_start = time.time()
    timings: dict[str, float] = {}
    torch.manual_seed(seed)
    rng = random.Random(seed)
    spec = text_spec()
    before = None
    if init is not None:
        from diffusers import StableDiffusion3Pipeline

        before = json.loads((Path(init) / "pretrain.json").read_text())
        pipe = StableDiffusion3Pipeline.from_pretrained(str(init), text_encoder_3=None, tokenizer_3=None).to(device)
        vae_steps = 0
    else:
        pipe = build_tiny_sd3(spec, seed).to(device)
    train_words, _ = text_task.split_words()
    # OCR only when evaluating: a GPU machine without the ocr extra can pretrain (--eval-samples 0)
    ocr = build_reward(OCR) if eval_samples > 0 else None

    # Phase 1: VAE reconstruction of freshly rendered signs.
    t0 = time.time()
    vae = pipe.vae
    vae_losses = train_vae(vae, lambda: (render_batch(rng.choices(train_words, k=vae_batch), rng) * 2 - 1).to(device),
                           vae_steps, progress=progress)
    timings["vae"] = time.time() - t0

    # A dataset of latents (rendering is cheap, encoding is not), and the OCR accuracy of reconstructions.
    t0 = time.time()
    words = rng.choices(train_words, k=num_images)
    prompts = [text_task.prompt_for(w, rng.randrange(len(text_task.TEMPLATES))) for w in words]
    with torch.no_grad():
        lat = torch.cat([vae.encode((render_batch(words[i : i + 256], rng) * 2 - 1).to(device)).latent_dist.mean
                         for i in range(0, num_images, 256)])
        recon = (vae.decode(lat[:128]).sample / 2 + 0.5).clamp(0, 1).cpu()
    recon_score = None
    if ocr is not None:
        recon_score = ocr(recon, prompts[: len(recon)], [{}] * len(recon)).scores.mean().item()
        tqdm.write(f"vae: OCR accuracy of reconstructions {recon_score:.3f} (renders: 1.0)")
    if init is None:
        shift, scale = lat.mean().item(), 1.0 / lat.std().item()
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    lat = (lat - shift) * scale
    timings["encode"] = time.time() - t0

    # Phase 2: rectified flow on the transformer + text encoder.
    t0 = time.time()
    flow_losses = train_flow([pipe.transformer, pipe.text_encoder], lat, prompts, *sd3_flow_calls(pipe), steps, batch,
                             lr, rng, progress)
    timings["flow"] = time.time() - t0

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fill_clip_g_slot(pipe)  # so that plain StableDiffusion3Pipeline.from_pretrained loads it (models/tiny.py)
    pipe.to("cpu").save_pretrained(str(out))
    if prompts_dir is not None:
        write_text_prompt_files(prompts_dir)
    heldout = None
    if eval_samples > 0:
        t0 = time.time()
        heldout = evaluate_text(out, text_task.make_prompts(text_task.split_words()[1])[:eval_samples], device=device)
        timings["eval"] = time.time() - t0
        tqdm.write(f"OCR accuracy of ODE samples on {eval_samples} held-out words: {heldout['score']:.3f} "
                   f"(exact {heldout['exact']:.3f})")
    timings["total"] = time.time() - t_start
    curve_every = max(1, steps // 10)
    (out / "pretrain.json").write_text(json.dumps({
        "task": "text", "command": f"polyrl pretrain-toy --task text --vae-steps {vae_steps} --steps {steps} "
        f"--num-images {num_images} --batch {batch} --vae-batch {vae_batch} --seed {seed} --device {device}"
        + (f" --threads {threads}" if threads is not None else "") + (f" --init {init}" if init is not None else ""),
        "height": text_task.HEIGHT, "width": text_task.WIDTH, "vae_steps": vae_steps, "steps": steps,
        "num_images": num_images, "batch": batch, "vae_batch": vae_batch, "lr": lr, "seed": seed, "threads": threads,
        "losses": {"vae_final": _mean_tail(vae_losses), "flow_final": _mean_tail(flow_losses),
                   "flow_curve": [_mean_tail(flow_losses[: i + curve_every]) for i in range(0, steps, curve_every)]},
        "vae_reconstruction_ocr": None if recon_score is None else round(recon_score, 4),
        "heldout_ocr": None if heldout is None else round(heldout["score"], 4),
        "heldout_exact": None if heldout is None else round(heldout["exact"], 4),
        "eval_samples": eval_samples, "eval": "ODE, 10 steps, guidance 1, noise seed 1234, reward=ocr detect=false",
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "torch": torch.__version__, "device": str(device),
        **({"continued_from": before} if before is not None else {}),
    }, indent=2))
    return out


def write_text_prompt_files(prompts_dir: str | Path, seed: int = 0) -> None:
    """`text_train.jsonl` (training words) and `text_heldout.jsonl` (held-out words, evaluation only)."""
    prompts_dir = Path(prompts_dir)
    prompts_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = text_task.split_words(seed)
    for name, rows in (("text_train.jsonl", text_task.make_prompts(train, seed)),
                       ("text_heldout.jsonl", text_task.make_prompts(heldout, seed))):
        with open(prompts_dir / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def evaluate_text(path: str | Path, rows: list[dict], num_steps: int = 10, device: str = "cpu", seed: int = 1234, guidance: float = 1.0,
                  grid: str | Path | None = None, checkpoint: str | Path | None = None) -> dict:
    """OCR accuracy (`reward=ocr`, recognition only) of ODE samples (fixed noise, the `sd3` adapter) for prompt
    rows {"prompt", "text"}: {"score": mean, "exact": share read exactly, "reads": what the OCR read}. `grid`: a
    PNG of the samples, each captioned with its target word, what the OCR read and the score. `checkpoint`: a
    run's `checkpoints/step_N` directory whose trained weights (LoRA) are loaded onto the model first."""
    from ...latents import MediaShape
    from ...models.base import Guidance
    from ...models.sd3 import SD3Policy
    from ...rewards import build_reward
    from ...sampling.diffusion import SamplingPlan, draw_noise, rollout

    adapter = SD3Policy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=TEXT_LENGTH),
                        torch.device(device))
    if checkpoint is not None:
        from ...actor.local import load_trained_weights

        load_trained_weights(adapter, Path(checkpoint))
    prompts, meta = [r["prompt"] for r in rows], [{"text": r["text"]} for r in rows]
    plan = SamplingPlan(num_steps=num_steps, shape=MediaShape(text_task.HEIGHT, text_task.WIDTH),
                        guidance=Guidance(guidance), noise_level=0.0, batch_size=64)
    groups = torch.arange(len(rows))
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        batch = rollout(adapter, prompts, meta, groups, plan, noise)
    images = batch.media["images"].float().cpu()
    ocr = build_reward(OCR)
    out = ocr(images, prompts, meta)
    reads = [ocr.read(a) for a in (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)]
    if grid is not None:
        from ...trainer.logging import save_grid

        save_grid(images, [f"{m['text']} -> {r or '(nothing)'}" for m, r in zip(meta, reads, strict=True)],
                  out.scores.tolist(), Path(grid))
    return {"score": out.scores.mean().item(), "exact": float(np.mean(out.extras["ocr/exact"])), "reads": reads}
