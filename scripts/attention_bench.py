"""Attention alone at the benchmark's shape, per kernel: SDPA's cuDNN, flash and memory-efficient backends and
flex_attention (Triton, compiled). Attention is a quarter of a bf16 SD3.5-M epoch's device time at head dim 64, half
the matmul rate (docs/performance.md, "Where an epoch's time goes"); this says whether another kernel does better.
Prints, per kernel: forward and forward+backward ms, TFLOP/s (forward 4·B·H·L²·D, backward 2.5× that), and the
largest difference of its output and input gradients from the first kernel's (cuDNN by default).

    python scripts/attention_bench.py          # 64 CFG rows x 24 heads x 1229 tokens x 64, bf16
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gpu_microbench import timed  # scripts/ is on sys.path when a script here runs
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def kernel(name: str):
    """attention(q, k, v) for `name`, inputs (B, H, L, D)."""
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=False)

    def sdpa(q, k, v):
        with sdpa_kernel([SDPA[name]]):
            return F.scaled_dot_product_attention(q, k, v)

    return sdpa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1229)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kernels", default="cudnn,flash,efficient,flex")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    b, h, n, d = args.batch, args.heads, args.tokens, args.head_dim
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=g).to(device, dtype) for _ in range(4))
    fwd_flops = 4 * b * h * n * n * d
    print(f"q/k/v ({b}, {h}, {n}, {d}) {dtype} on {device}; forward {fwd_flops / 1e12:.3f} TFLOP per call", flush=True)
    reference = None
    for name in args.kernels.split(","):
        attend = kernel(name)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def forward(attend=attend, leaves=leaves):
            with torch.no_grad():
                return attend(*leaves)

        def train(attend=attend, leaves=leaves):
            for t in leaves:
                t.grad = None
            attend(*leaves).backward(grad)

        try:
            t0 = time.perf_counter()
            train()
            first_s = time.perf_counter() - t0
            out = forward()
            train()
            result = [out.float(), *(t.grad.float() for t in leaves)]
            f_ms, t_ms = timed(forward), timed(train)
        except RuntimeError as e:  # a backend that does not take this shape, dtype or GPU
            print(f"{name:10s} unavailable: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        if reference is None:
            reference = result
        diff = max(float((a - r).abs().max()) for a, r in zip(result, reference, strict=True))
        print(f"{name:10s} fwd {f_ms:8.3f} ms {fwd_flops / f_ms / 1e9:6.0f} TFLOP/s | fwd+bwd {t_ms:8.3f} ms "
              f"{3.5 * fwd_flops / t_ms / 1e9:6.0f} TFLOP/s | max |Δ| vs first kernel {diff:.2e} | first call {first_s:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
