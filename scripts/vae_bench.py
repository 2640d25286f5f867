"""SD3.5 VAE decode timings at the docs/benchmark.md shape (16 latents of 16×64×64 → 512² images), per variant:
weights float32 or bf16, NCHW or channels_last, eager or torch.compile'd decoder. Prints ms per call, the
decoder's conv TFLOP/s, and the largest pixel difference from the float32 NCHW decode.

    python scripts/vae_bench.py [--batch 16] [--variants fp32-autocast,fp32-autocast-cl,bf16-cl,bf16-cl-compile]
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKL
from gpu_microbench import timed

SD35_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.5305, shift_factor=0.0609,
                use_quant_conv=False, use_post_quant_conv=False)


def decoder_conv_flops(vae: AutoencoderKL, z: torch.Tensor) -> float:
    """2·MACs of every Conv2d of the decoder, counted with forward hooks on one eager float32 call."""
    total = 0.0

    def hook(m, inp, out):
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1] * m.in_channels // m.groups
        total += 2.0 * out.numel() * k

    hs = [m.register_forward_hook(hook) for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        vae.decode(z[:1], return_dict=False)
    for h in hs:
        h.remove()
    return total * z.shape[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--variants", default="fp32-autocast,fp32-autocast-cl,bf16-cl,bf16-cl-compile,fp32-autocast-cl-compile")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = AutoencoderKL(**SD35_VAE).eval().requires_grad_(False)
    z = torch.randn(args.batch, 16, 64, 64, device=dev)
    ref_vae = base.to(dev)
    flops = decoder_conv_flops(ref_vae, z)
    with torch.no_grad():
        ref = ref_vae.decode(z, return_dict=False)[0].float()
    print(f"decoder conv work: {flops / args.batch / 1e12:.3f} TFLOP per image", flush=True)
    for name in args.variants.split(","):
        vae = AutoencoderKL(**SD35_VAE).eval().requires_grad_(False)
        vae.load_state_dict(base.state_dict())
        dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
        fmt = torch.channels_last if "-cl" in name else torch.contiguous_format
        vae = vae.to(dev, dtype).to(memory_format=fmt)
        if name.endswith("compile"):
            vae.decoder.compile()
        autocast = "autocast" in name

        def call(vae=vae, dtype=dtype, fmt=fmt, autocast=autocast):
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                return vae.decode(z.to(dtype).contiguous(memory_format=fmt), return_dict=False)[0]

        ms = timed(call, reps=6)
        diff = (call().float() - ref).abs().max().item() / 2  # images in [-1, 1] → pixel scale [0, 1]
        print(f"{name:28s} {ms:8.1f} ms/call  {flops / ms / 1e9:6.1f} TFLOP/s  max |Δpixel| {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
