"""The memory plan (polyrl/trainer/memory_plan.py) against every peak GPU memory recorded in docs/bench/*.json: the
plan's estimate, the measured peak and the error of each, as a markdown table (docs/memory.md holds its output).

The checkpoints are built on the `meta` device from `polyrl bench`'s specs (no memory, no files: the plan reads the
same tensor shapes a saved checkpoint's headers give); each run's config is its recipe with the overrides it ran
with, and the recipe values of its date where they changed since (each entry says which).

    python scripts/plan_calibration.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
SD = ["recipe=sd35m_flowgrpo_bench"]
B32 = ["rollout.batch_size=32", "actor.micro_batch_size=32"]
QWEN = ["recipe=qwen_image_flowgrpo", "data.prompts_per_step=4"]
QWEN_1202 = [*QWEN, "actor.micro_batch_size=2", "actor.gradient_checkpointing=false", "model.compile=none",
             "model.fp8=false"]  # the recipe until 2026-12-04: 2 images per training call, eager, no checkpointing
WAN = ["recipe=wan22_flowgrpo", "data.prompts_per_step=2", "rollout.batch_size=4", "actor.micro_batch_size=1",
       "actor.num_minibatches=1"]  # bench's wan22_5b workload
A14B = ["recipe=wan22_a14b_flowgrpo", "data.prompts_per_step=1", "rollout.n=4", "actor.num_minibatches=1"]
LM = ["recipe=causal_lm_grpo", "data.prompts_per_step=8", "rollout.n=8", "rollout.batch_size=64",
      "rollout.max_new_tokens=512", "model.max_sequence_length=1024"]
# (bench file, workload, config overrides, GPUs); the measured peak is the file's peak_memory_gib (rank 0)
RUNS = [
    ("2026-12-02_sd35m_batch8.json", "sd35m", [*SD, "model.fp8=false"], 1),
    ("2026-12-02_sd35m_batch16.json", "sd35m", [*SD, "model.fp8=false", "rollout.batch_size=16",
                                                "actor.micro_batch_size=16"], 1),
    ("2026-12-03_sd35m_bf16_batch32.json", "sd35m", [*SD, *B32, "model.fp8=false"], 1),
    ("2026-12-03_sd35m_fp8_batch16.json", "sd35m", [*SD, "rollout.batch_size=16", "actor.micro_batch_size=16",
                                                    "model.fp8=true"], 1),
    ("2026-12-03_sd35m_fp8_batch32.json", "sd35m", [*SD, *B32, "model.fp8=true"], 1),
    ("2026-12-04_sd35m_fp8_eager_16_per_call.json", "sd35m", [*SD, "rollout.batch_size=16", "actor.micro_batch_size=16",
                                                              "model.fp8=true", "model.compile=none"], 1),
    ("2026-12-04_sd35m_full_ft_local.json", "sd35m", [*SD, "rollout.batch_size=32", "actor.micro_batch_size=8",
                                                      "actor.lora_rank=0", "model.compile=none"], 1),
    ("2026-12-04_sd35m_fsdp2_world1.json", "sd35m", [*SD, *B32, "actor.backend=fsdp2", "model.fp8=false"], 1),
    ("2026-12-04_sd35m_full_ft_fsdp2_world1.json", "sd35m", [*SD, "rollout.batch_size=32", "actor.micro_batch_size=8",
                                                             "actor.lora_rank=0", "model.compile=none",
                                                             "actor.backend=fsdp2"], 1),
    ("2026-12-04_x2_sd35m_2gpu_local.json", "sd35m", [*SD, *B32, "model.fp8=false"], 2),
    ("2026-12-04_x2_sd35m_2gpu_fsdp2.json", "sd35m", [*SD, *B32, "actor.backend=fsdp2", "model.fp8=false"], 2),
    ("2026-12-02_qwen_image.json", "qwen_image", QWEN_1202, 1),
    ("2026-12-03_qwen_image_fp8_compiled.json", "qwen_image", [*QWEN_1202, "model.compile=blocks", "model.fp8=true"], 1),
    ("2026-12-04_qwen_image_fp8_compiled_gradckpt_mb8_64img.json", "qwen_image", [*QWEN, "model.fp8=true"], 1),
    ("2026-12-04_qwen_image_fp8_compiled_gradckpt_mb8_32img.json", "qwen_image",
     [*QWEN, "model.fp8=true", "data.prompts_per_step=2"], 1),
    ("2026-12-04_qwen_image_defaults_8_per_call.json", "qwen_image",
     [*QWEN, "model.fp8=true", "data.prompts_per_step=2", "rollout.batch_size=8"], 1),
    ("2026-12-03_wan22_5b_full_gradckpt.json", "wan22_5b", [*WAN, "actor.gradient_checkpointing=true",
                                                            "model.compile=none"], 1),
    ("2026-12-04_wan22_5b_compiled_blocks_bf16_decode.json", "wan22_5b", [*WAN, "actor.gradient_checkpointing=true"], 1),
    ("2026-12-04_wan22_5b_gradckpt0.5_vae_dynamic.json", "wan22_5b", [*WAN, "actor.gradient_checkpointing=0.5"], 1),
    ("2026-12-04_wan22_5b_gradckpt0.2_vae_static.json", "wan22_5b", [*WAN, "actor.gradient_checkpointing=0.2"], 1),
    ("2026-12-04_wan22_5b_no_gradckpt_vae_static.json", "wan22_5b", [*WAN, "actor.gradient_checkpointing=false"], 1),
    ("2026-12-04_x2_wan22_5b_fsdp2_sp1.json", "wan22_5b", [*WAN, "actor.backend=fsdp2", "model.compile=none"], 1),
    ("2026-12-04_x2_wan22_5b_fsdp2_sp2.json", "wan22_5b", [*WAN, "actor.backend=fsdp2", "model.compile=none",
                                                           "parallel.sp=2"], 2),
    ("2026-12-04_wan22_5b_sp2_gradckpt_x2.json", "wan22_5b", [*WAN, "actor.backend=fsdp2", "model.compile=none",
                                                              "parallel.sp=2", "actor.gradient_checkpointing=true"], 2),
    ("2026-12-04_wan22_a14b_lora_gradckpt.json", "wan22_a14b", [*A14B, "model.compile=none"], 1),
    ("2026-12-04_wan22_a14b_both_experts.json", "wan22_a14b", [*A14B, "model.compile=none",
                                                               "rollout.sde_window_range=[6,6]"], 1),
    ("2026-12-04_wan22_a14b_compiled_blocks.json", "wan22_a14b", [*A14B, "model.compile=blocks",
                                                                  "rollout.sde_window_range=[6,6]"], 1),
    ("2026-12-04_grpo_lm_polyrl.json", "grpo_lm", LM, 1),
    ("2026-12-04_grpo_lm_polyrl_cuda_graphs.json", "grpo_lm", LM, 1),
    ("2026-12-04_grpo_lm_polyrl_cuda_graphs_recompute.json", "grpo_lm", [*LM, "rollout_correction.mode=recompute"], 1),
    ("2026-12-04_grpo_lm_polyrl_static_cache_eager.json", "grpo_lm", [*LM, "model.options.cuda_graphs=false"], 1),
]


def meta_inventory(workload: str) -> dict:
    """The published-size checkpoint of a bench workload, built on the meta device (shapes only)."""
    import torch

    from polyrl.cli.bench import bench_prompts, sd35_medium_spec
    from polyrl.models.tiny import (
        build_tiny_qwen_image,
        build_tiny_sd3,
        build_tiny_wan,
        qwen_image_bench_spec,
        wan_bench_spec,
    )
    from polyrl.trainer.memory_plan import inventory_from_modules

    words = sorted({w for p in bench_prompts(64) for w in p.replace('"', ' " ').split()})
    if workload == "sd35m":
        pipe = build_tiny_sd3(sd35_medium_spec(words), device="meta")
    elif workload == "qwen_image":
        pipe = build_tiny_qwen_image(qwen_image_bench_spec(words), device="meta", dtype=torch.bfloat16)
    elif workload in ("wan22_5b", "wan22_ti2v", "wan22_a14b"):
        import dataclasses

        spec = wan_bench_spec(words, "wan2.2-a14b" if workload == "wan22_a14b" else "wan2.2-ti2v")
        spec = dataclasses.replace(spec, image_to_video=workload == "wan22_ti2v")  # TI2V-5B as image-to-video
        pipe = build_tiny_wan(spec, device="meta", dtype=torch.bfloat16)
    elif workload == "grpo_lm":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
        return inventory_from_modules({"model": model})
    else:
        raise ValueError(workload)
    return inventory_from_modules(pipe.components)


def main() -> int:
    from polyrl.config import load_config
    from polyrl.trainer.memory_plan import estimate

    inventories, rows, errors = {}, [], []
    for name, workload, overrides, gpus in RUNS:
        measured = json.loads((BENCH / name).read_text())["peak_memory_gib"]
        if workload not in inventories:
            inventories[workload] = meta_inventory(workload)
        os.environ["WORLD_SIZE"] = str(gpus)  # the config checks parallel degrees against the world
        try:
            cfg = load_config([*overrides, "model.path=/nonexistent", "data.path=/nonexistent.txt"])
        finally:
            os.environ.pop("WORLD_SIZE", None)
        prompt_tokens = 256 if workload == "grpo_lm" else None  # the bench's prompts (model.max_sequence_length caps)
        plan = estimate(cfg, inventories[workload], gpus, prompt_tokens=prompt_tokens)
        err = (plan.peak_gib - measured) / measured
        errors.append(abs(err))
        if "-v" in sys.argv:
            print(f"{name}: measured {measured:.1f}\n{plan.table()}\n", file=sys.stderr)
        top = max(plan.peaks, key=lambda x: x.gib)
        rows.append(f"| `{name}` | {' '.join(o for o in overrides if not o.startswith('recipe='))} | {gpus} | "
                    f"{measured:.1f} | {plan.peak_gib:.1f} | {100 * err:+.1f}% | {top.what.split(': ')[-1]} |")
    print("| recorded run (docs/bench/) | config beyond the recipe | GPUs | measured GiB | plan GiB | error | peak in |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    within = sum(e <= 0.15 for e in errors)
    print(f"\n{within} of {len(errors)} within 15%; mean |error| {100 * sum(errors) / len(errors):.1f}%, "
          f"largest {100 * max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
