"""Peak GPU memory of the Wan2.2-A14B LoRA workload at larger videos: what fits one GPU.

    python scripts/wan_memory_probe.py --model-dir /tmp/bench/wan22_a14b_random --frames 49 81 [--height 704 --width 1280]

Loads the pipeline as `polyrl bench --workload wan22_a14b` trains it (both experts, LoRA r64 α128 on each,
activation checkpointing, bf16 autocast) and, per frame count, runs what dominates each stage's memory:
one guided sampling call of one video (no grad: 2 sequences, condition and CFG's empty prompt) and one training
micro-batch (one video, guided, with grad through the high-noise expert, then backward), with the float32
LoRA weights, gradients and AdamW state of both experts allocated. Prints the peak memory and
seconds of each; an out-of-memory error is reported as such and the next (smaller) shape is not skipped.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--frames", type=int, nargs="+", default=[49, 81])
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--stages", nargs="+", default=["training", "sampling"], choices=["training", "sampling"])
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script on a tiny pipeline (no memory figures)")
    a = p.parse_args()

    from polyrl.actor.local import add_lora
    from polyrl.cli.bench import WORKLOADS
    from polyrl.config import load_config
    from polyrl.latents import MediaShape
    from polyrl.models.base import Guidance, build_model

    recipe, extra = WORKLOADS["wan22_a14b"]
    cuda = a.device.startswith("cuda")
    gib = (lambda f: f() / 2**30) if cuda else (lambda f: float("nan"))
    cfg = load_config([f"recipe={recipe}", *extra, f"model.path={a.model_dir}", f"trainer.device={a.device}",
                       "data.path=unused.txt"])  # the probe reads no prompts file
    device = torch.device(a.device)
    t0 = time.perf_counter()
    adapter = build_model(cfg.model, device)
    for network in adapter.modules().values():
        add_lora(network, cfg.actor.lora_rank, cfg.actor.lora_alpha, list(adapter.default_lora_targets))
        network.enable_gradient_checkpointing()
        for q in network.parameters():
            if q.requires_grad:
                q.data = q.data.float()  # the actor's float32 master weights
    load_s = time.perf_counter() - t0
    # the optimizer's state and both experts' gradients exist throughout an update: allocate them first
    params = [q for network in adapter.modules().values() for q in network.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    for q in params:
        q.grad = torch.zeros_like(q)
    optimizer.step()
    cond = adapter.encode_prompts(["a red fox running through fresh snow at dawn"])
    shared = adapter.encode_guidance(Guidance(a.guidance))
    weights_gib = gib(torch.cuda.memory_allocated)
    print(f"loaded in {load_s:.1f} s; {sum(q.numel() for q in params) / 1e6:.0f} M trainable; weights, LoRA, gradients and "
          f"AdamW state {weights_gib:.1f} GiB", flush=True)
    results = []
    for frames in a.frames:
        shape = adapter.latent_shapes(MediaShape(a.height, a.width, frames=frames))["x"]
        row = {"frames": frames, "height": a.height, "width": a.width, "latent": list(shape)}
        sigma = torch.tensor([0.95], device=device)  # high-noise expert (t ≥ 875)
        for stage in a.stages:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            latents = {"x": torch.randn(1, *shape, device=device)}
            start = time.perf_counter()
            try:
                with torch.set_grad_enabled(stage == "training"):
                    v = adapter.velocity(latents, sigma, cond, shared, a.guidance)["x"]
                    if stage == "training":
                        v.float().square().mean().backward()
                if cuda:
                    torch.cuda.synchronize()
                row[f"{stage}_s"] = time.perf_counter() - start
                row[f"{stage}_peak_gib"] = gib(torch.cuda.max_memory_allocated)
            except torch.OutOfMemoryError:
                row[f"{stage}_peak_gib"] = "out of memory"
            finally:
                v = None
                optimizer.zero_grad(set_to_none=False)
        print(json.dumps(row), flush=True)
        results.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"load_s": load_s, "weights_gib": weights_gib, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
