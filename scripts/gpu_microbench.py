"""Transformer-only timings of the docs/benchmark.md shape on a GPU: forward (no grad) and LoRA training passes,
eager vs compiled, per attention backend and processor (`-jattn`: polyrl's JointAttention), and batch. Prints one line per variant: ms, model TFLOP/s, MFU.

    python scripts/gpu_microbench.py PIPELINE_DIR|random [--peak TFLOPS] [--variants eager,blocks,blocks-fp8,...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from diffusers import SD3Transformer2DModel

from polyrl.actor.local import add_lora
from polyrl.models.sd3 import SD3_LORA_TARGETS, sd3_forward_flops, use_joint_attention
from polyrl.perf.compile import compile_transformer
from polyrl.perf.fp8 import apply_fp8

SD35M_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                         dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")


def timed(fn, reps=8, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("pipeline")
    p.add_argument("--peak", type=float, default=790.0)
    p.add_argument("--variants", default="eager,eager-cudnn,blocks,blocks-b32,full")
    a = p.parse_args()
    for variant in a.variants.split(","):
        run_variant(a.pipeline, variant, a.peak)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_variant(pipeline: str, variant: str, peak: float) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if pipeline == "random":  # the SD3.5-medium transformer with random weights, built on the GPU (seconds)
        with torch.device(dev):
            model = SD3Transformer2DModel(**SD35M_TRANSFORMER).to(torch.bfloat16)
    else:
        model = SD3Transformer2DModel.from_pretrained(pipeline, subfolder="transformer", torch_dtype=torch.bfloat16).to(dev)
    if "jattn" in variant:  # polyrl's copy-free joint attention (the adapter's default) instead of diffusers'
        use_joint_attention(model)
    add_lora(model, 32, 64, SD3_LORA_TARGETS)
    if "fp8" in variant:
        apply_fp8(model)
    for prm in model.parameters():
        if prm.requires_grad:
            prm.data = prm.data.float()
    b = 32 if "b32" in variant else 16
    inputs = dict(hidden_states=torch.randn(b, 16, 64, 64, device=dev).bfloat16(), timestep=torch.rand(b, device=dev) * 1000,
                  encoder_hidden_states=torch.randn(b, 205, 4096, device=dev).bfloat16(),
                  pooled_projections=torch.randn(b, 2048, device=dev).bfloat16(), return_dict=False)
    flops = sd3_forward_flops(model.config, 1024, 205) * b
    backend = contextlib.nullcontext()
    if "cudnn" in variant:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
    t0 = time.perf_counter()
    compile_transformer(model, "full" if variant.startswith("full") else "blocks" if variant.startswith("blocks") else "none")

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(**inputs)[0]

    def train():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs)[0]
        out.float().square().mean().backward()

    with backend:
        fwd()
        train()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        f_ms, t_ms = timed(fwd), timed(train)
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(f"{variant:14s} batch {b:3d} | fwd {f_ms:7.1f} ms {flops / f_ms / 1e9:6.0f} TFLOP/s {100 * flops / f_ms / 1e9 / peak:5.1f}% "
          f"| train {t_ms:7.1f} ms {3 * flops / t_ms / 1e9:6.0f} TFLOP/s {100 * 3 * flops / t_ms / 1e9 / peak:5.1f}% "
          f"| first call (incl. compile) {first:6.1f} s | peak {mem:5.1f} GiB", flush=True)

if __name__ == "__main__":
    main()
