"""Where the compiled SD3.5-M block spends its GPU time: kernel time shares by kind (matmul, attention, fused
elementwise, copies, other) for one forward and one LoRA training pass, with torch.profiler.

    python scripts/gpu_profile.py [--fp8] [--batch 16]

The FLOP shares of ALGORITHMS.md §6 say linear layers are ~86% of the work; this says how much of the *time* they
are (docs/performance.md, prediction 6), which decides the next lever.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from diffusers import SD3Transformer2DModel
from gpu_microbench import SD35M_TRANSFORMER
from torch.profiler import ProfilerActivity, profile

from polyrl.actor.local import add_lora
from polyrl.models.sd3 import SD3_LORA_TARGETS
from polyrl.perf.compile import compile_transformer
from polyrl.perf.fp8 import apply_fp8

KINDS = [("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
         ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "matmul", "scaled_mm", "xmma")),
         ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
         ("fused elementwise", ("triton",))]


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(key in low for key in keys):
            return k
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    dev = torch.device("cuda")
    with torch.device(dev):
        model = SD3Transformer2DModel(**SD35M_TRANSFORMER).to(torch.bfloat16)
    add_lora(model, 32, 64, SD3_LORA_TARGETS)
    for prm in model.parameters():
        if prm.requires_grad:
            prm.data = prm.data.float()
    if a.fp8:
        apply_fp8(model)
    compile_transformer(model, "blocks")
    b = a.batch
    inputs = dict(hidden_states=torch.randn(b, 16, 64, 64, device=dev).bfloat16(), timestep=torch.rand(b, device=dev) * 1000,
                  encoder_hidden_states=torch.randn(b, 205, 4096, device=dev).bfloat16(),
                  pooled_projections=torch.randn(b, 2048, device=dev).bfloat16(), return_dict=False)

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(**inputs)

    def train():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs)[0]
        out.float().square().mean().backward()

    for name, fn in (("forward", fwd), ("train", train)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        shares, top = defaultdict(float), []
        for e in prof.key_averages():
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            if t > 0:
                shares[kind(e.key)] += t
                top.append((t, e.key))
        total = sum(shares.values())
        print(f"== {name} (batch {b}, fp8={a.fp8}): {total / 3 / 1e3:.1f} ms of kernels per pass")
        for k, t in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"   {k:18s} {100 * t / total:5.1f}%")
        for t, key in sorted(top, reverse=True)[:8]:
            print(f"   {100 * t / total:5.1f}%  {key[:100]}")


if __name__ == "__main__":
    main()
