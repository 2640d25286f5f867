"""Flow-GRPO throughput of `model=diffusers_pipeline` (the pipeline's own loop, recorded and replayed) against the
dedicated `model=sd3` adapter, on the same random-weight SD3.5-medium pipeline (docs/benchmark.md's workload, built
by `polyrl bench`'s builder: the published transformer and VAE, small CLIP/T5 stand-ins), in one process.

Each path trains `--warmup + --epochs` Flow-GRPO steps (rollout of `rollout.num_steps` steps with the SDE window of
the bench recipe, reward, update) through the normal trainer (`polyrl bench`'s `run_bench`); the median measured
step gives images/s. Both run the same settings: bf16 transformer, LoRA r32, CFG 4.5, 512², 10 steps, window 9, no
torch.compile and no FP8 by default (what the generic path is compared on; pass `model.compile=blocks` or
`++model.fp8=true` to set them for both). Prints a table and, last, one JSON line.

    python scripts/generic_pipeline_bench.py --tiny                 # CPU, a tiny SD3, seconds (checks it runs)
    python scripts/generic_pipeline_bench.py --out /tmp/gpb         # GPU: SD3.5-M shape, 2 prompts x 8 images

On one H100 the default (1 warm-up + 1 measured step per path, 16 images each) should take about 3 minutes with the
build (eager bf16 SD3.5-M at 8 images per call: ≈ 1 image/s, peak ≈ 30-45 GiB; estimates, not measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from polyrl.cli.bench import build_pipeline, run_bench

# the same Flow-GRPO settings for both paths (the bench recipe's, with 2 prompts x 8 images per step: images/s does
# not depend on the number of prompts at a fixed per-call batch, 8 images = 16 CFG rows)
COMMON = ["data.prompts_per_step=2", "rollout.n=8", "rollout.batch_size=8", "actor.micro_batch_size=8",
          "actor.num_minibatches=2", "++model.compile=none", "++model.fp8=false", "rollout.training_graph=false",
          "trainer.eval_every=0", "trainer.save_every=0", "trainer.tensorboard=false", "trainer.progress=false"]
TINY = ["data.prompts_per_step=2", "rollout.n=2", "rollout.batch_size=4", "actor.micro_batch_size=2",
        "rollout.num_steps=3", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]"]
PATHS = {  # name -> overrides that pick the path
    "sd3": [],
    "diffusers_pipeline": ["model=diffusers_pipeline"],
}


def one_path(name: str, out: Path, model_dir: Path, tiny: bool, epochs: int, warmup: int, extra: list[str]) -> dict:
    """Train one path and keep what the comparison reads."""
    t0 = time.perf_counter()
    # the T5 length of the dedicated run (the recipe's 128 tokens; 16 in the tiny overrides of `polyrl bench`)
    tokens = [f"model.options.max_sequence_length={16 if tiny else 128}"] if name == "diffusers_pipeline" else []
    result = run_bench(out / name, tiny, epochs, warmup, COMMON + (TINY if tiny else []) + PATHS[name] + tokens + extra,
                       model_dir, "sd35m")
    s = result["summary"]
    row = {"images_per_s": s["images_per_s"], "seconds_per_step": s["seconds_per_epoch"],
           "images_per_step": s["images_per_epoch"], "rollout_s": s["stages_s"]["rollout"],
           "train_s": s["stages_s"]["train"], "peak_memory_gib": result["peak_memory_gib"],
           "ratio_absdev_first_minibatch": s.get("ratio_absdev_first_minibatch"), "wall_s": time.perf_counter() - t0}
    gc.collect()  # the trainer is gone: free its GPU memory before the other path measures its peak
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny SD3 at 64x64, 3 steps (runs on a CPU in seconds)")
    p.add_argument("--epochs", type=int, default=1, help="measured Flow-GRPO steps per path (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="runs/generic_pipeline_bench")
    a, extra = p.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    out = Path(a.out)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = build_pipeline(out / f"sd35m_{'tiny' if a.tiny else 'random'}", a.tiny, device)
    build_s = time.perf_counter() - t0
    rows = {name: one_path(name, out, model_dir, a.tiny, a.epochs, a.warmup, extra) for name in PATHS}
    print(f"{'path':<20} {'images/s':>9} {'s/step':>8} {'rollout s':>10} {'train s':>8} {'peak GiB':>9} {'|rho-1|':>9}")
    for name, r in rows.items():
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        absdev = r["ratio_absdev_first_minibatch"]
        print(f"{name:<20} {r['images_per_s']:>9.3f} {r['seconds_per_step']:>8.2f} {r['rollout_s']:>10.2f} "
              f"{r['train_s']:>8.2f} {peak:>9} {absdev if absdev is None else f'{absdev:.1e}':>9}")
    ratio = rows["diffusers_pipeline"]["images_per_s"] / rows["sd3"]["images_per_s"]
    print(f"generic / dedicated images/s: {ratio:.3f}")
    summary = {"workload": "sd35m" + (" (tiny)" if a.tiny else ""), "device": torch.cuda.get_device_name()
               if torch.cuda.is_available() else "cpu", "settings": COMMON + (TINY if a.tiny else []) + extra,
               "build_s": build_s, "paths": rows, "generic_over_dedicated": ratio,
               "total_s": time.perf_counter() - t0}
    (out / "generic_pipeline_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
