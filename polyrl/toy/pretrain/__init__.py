"""Pretraining of the shipped toy base models (`polyrl pretrain-toy`), one module per task:

- `shapes` (shapes.py, the default): coloured shapes, an SD3-layout text-to-image model (`polyrl/assets/toy_shapes`);
- `motion` (motion.py): moving shapes, a Wan2.1-layout text-to-video model (`toy_motion`);
- `count` (count.py): a tiny Qwen3-class causal LM that counts the shapes a scene description names (`toy_count`);
- `text` (text.py): an SD3-layout model that writes the quoted word of a prompt, the base of `recipe=toy_ocr`
  (`toy_text`);
- `rewrite` (rewrite.py): a tiny causal LM that rewrites shapes requests for the toy_shapes generator, the base of
  `recipe=toy_rewriter` (`toy_rewriter`).

loops.py holds the training loops they share. This package sits above the trainer in the layers (it scores with
the rewards, samples with the adapters and writes grids), while the task definitions in `polyrl/toy/` sit low (the
rewards read them).
"""

from __future__ import annotations

from pathlib import Path

# Per task: where the model goes (under polyrl/assets/) and the default (CPU) budget.
DEFAULTS = {
    "shapes": dict(out="toy_shapes", vae_steps=1000, steps=2500, num_images=16000, batch=64),
    "motion": dict(out="toy_motion", vae_steps=400, steps=2000, num_images=4000, batch=32),
    "count": dict(out="toy_count", vae_steps=0, steps=600, num_images=0, batch=64),  # a text model: no VAE, no images
    "text": dict(out="toy_text", vae_steps=300, steps=2000, num_images=8000, batch=32),
    "rewrite": dict(out="toy_rewriter", vae_steps=0, steps=800, num_images=0, batch=64),  # a text model
}


def pretrain(task: str, out: str | Path, vae_steps: int, steps: int, num_images: int, batch: int, seed: int,
             prompts_dir: str | Path, device: str, vae_batch: int, eval_samples: int, threads: int | None = None,
             init: str | None = None) -> Path:
    """Train the toy model of `task` into `out` with that budget (`num_images`: images, or clips for motion; unused by
    the text models); returns its directory."""
    if task == "shapes":
        from .shapes import pretrain_toy

        return pretrain_toy(out, vae_steps=vae_steps, steps=steps, num_images=num_images, batch=batch, seed=seed,
                            prompts_dir=prompts_dir, device=device)
    if task == "text":
        from .text import pretrain_text

        return pretrain_text(out, vae_steps=vae_steps, steps=steps, num_images=num_images, batch=batch, seed=seed,
                             prompts_dir=prompts_dir, device=device, eval_samples=eval_samples, vae_batch=vae_batch,
                             threads=threads, init=init)
    if task == "rewrite":
        from .rewrite import pretrain_rewrite

        return pretrain_rewrite(out, steps=steps, batch=batch, seed=seed, prompts_dir=prompts_dir, device=device,
                                eval_samples=eval_samples)
    if task == "count":
        from .count import pretrain_count

        return pretrain_count(out, steps=steps, batch=batch, seed=seed, prompts_dir=prompts_dir, device=device,
                              eval_samples=eval_samples)
    if task == "motion":
        from .motion import pretrain_motion

        return pretrain_motion(out, vae_steps=vae_steps, steps=steps, num_clips=num_images, batch=batch, seed=seed,
                               prompts_dir=prompts_dir, device=device, vae_batch=vae_batch, eval_samples=eval_samples)
    raise ValueError(f"unknown toy task {task!r}; tasks: {', '.join(DEFAULTS)}")
