"""`polyrl pretrain-toy [--task shapes|motion|count|text|rewrite] [--device cuda] [--out DIR] ...`: re-make a shipped
toy base model; the training is polyrl/toy/pretrain/ (one module per task)."""

from __future__ import annotations

import argparse

from ..toy.pretrain import DEFAULTS


def main(args: list[str]) -> int:
    from ..config import ASSETS
    from ..toy.pretrain import pretrain

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
    path = pretrain(a.task, a.out or str(ASSETS / d["out"]), **budget, seed=a.seed, prompts_dir=a.prompts_dir,
                    device=a.device, vae_batch=a.vae_batch, eval_samples=a.eval_samples, threads=a.threads, init=a.init)
    print(f"polyrl: wrote {path}")
    return 0
