"""Where the compiled SD3.5-M transformer spends its GPU time, for one forward and one LoRA training pass.

    python scripts/gpu_profile.py [--fp8] [--batch 32]

Per pass it prints: wall time (CUDA events) against the sum of kernel times (the difference is GPU idle time,
i.e. launch-bound gaps), the kernel time shares by kind (matmul, attention, fused elementwise, copies, other)
with the largest kernels, and the same pass with the LoRA adapters disabled (the LoRA cost; for training the
LoRA-free pass still back-propagates to the input, like the frozen base does under LoRA). The FLOP shares of
docs/algorithms.md §6 say linear layers are ~86% of the work; this says how much of the *time* they are
(docs/performance.md, prediction 6), which decides the next lever.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from diffusers import SD3Transformer2DModel
from gpu_microbench import SD35M_TRANSFORMER, timed
from torch.profiler import ProfilerActivity, profile

from polyrl.actor.local import add_lora
from polyrl.models.sd3 import SD3_LORA_TARGETS
from polyrl.perf.compile import compile_transformer
from polyrl.perf.fp8 import apply_fp8
from polyrl.perf.profile import kernel_kind


def kernel_profile(fn, reps: int = 3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    shares, top = defaultdict(float), []
    for e in prof.key_averages():
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if t > 0:
            shares[kernel_kind(e.key)] += t
            top.append((t, e.count // reps, e.key))
    return shares, top, sum(shares.values()) / reps / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--batch", type=int, default=32, help="CFG rows per call (16 images × 2 = 32)")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
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

    x_grad = inputs["hidden_states"].clone().requires_grad_(True)

    def train_no_lora():  # frozen everything, gradient to the input only: the base part of a LoRA backward
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**{**inputs, "hidden_states": x_grad})[0]
        out.float().square().mean().backward()

    rows = []
    for name, fn, lora in (("forward", fwd, True), ("train", train, True), ("forward", fwd, False),
                           ("train", train_no_lora, False)):
        if not lora:
            model.disable_adapters()
        for _ in range(3):  # compile + warm up
            fn()
        torch.cuda.synchronize()
        wall = timed(fn, reps=5, warmup=0)
        shares, top, kernels = kernel_profile(fn)
        if not lora:
            model.enable_adapters()
        rows.append((name, lora, wall, kernels))
        total = sum(shares.values())
        print(f"== {name}, LoRA {'on' if lora else 'off'} (batch {b}, fp8={a.fp8}): wall {wall:.1f} ms, "
              f"kernels {kernels:.1f} ms ({100 * (1 - kernels / wall):.1f}% idle)", flush=True)
        for k, t in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"   {k:18s} {100 * t / total:5.1f}%  {t / 3 / 1e3:7.1f} ms")
        for t, n, key in sorted(top, reverse=True)[:12]:
            print(f"   {100 * t / total:5.1f}%  x{n:<4d} {key[:110]}")
    print(f"\n| pass | LoRA | wall ms | kernel ms |  (batch {b}, fp8={a.fp8})")
    for name, lora, wall, kernels in rows:
        print(f"| {name} | {'on' if lora else 'off'} | {wall:.1f} | {kernels:.1f} |")


if __name__ == "__main__":
    main()
