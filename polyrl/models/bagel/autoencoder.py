"""The FLUX.1 autoencoder BAGEL generates in (`ae.safetensors`, Black Forest Labs' original key layout).

BAGEL ships the FLUX.1 VAE as one safetensors file without a config (its code hard-codes the geometry: 3 → 16
channels, ch 128, ch_mult (1, 2, 4, 4), 2 res blocks, 8× downsampling, scale 0.3611, shift 0.1159). This module
rebuilds that network under the file's own names (`encoder.down.0.block.1.conv1.weight`, `decoder.mid.attn_1.q.
weight`, ...) and reads the geometry from the tensors' shapes, so a smaller file of the same layout loads too.
It is the same network as diffusers' `AutoencoderKL` with FLUX's config (not checked against it here).

Latents in BAGEL's space: z = scale · (posterior mean − shift); decoding inverts it. Images are in [−1, 1].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCALE_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's latent normalisation (BAGEL's load_ae)


@dataclass(frozen=True)
class AutoencoderGeometry:
    in_channels: int = 3
    out_channels: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_state_dict(cls, state: dict) -> AutoencoderGeometry:
        """The geometry the tensors of an `ae.safetensors` file imply."""
        ch, in_channels = state["encoder.conv_in.weight"].shape[:2]
        levels = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.(\d+)\.", k))})
        blocks = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))}
        mult = tuple(state[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] // ch for i in levels)
        return cls(in_channels=in_channels, out_channels=state["decoder.conv_out.weight"].shape[0], ch=ch,
                   ch_mult=mult, num_res_blocks=len(blocks), z_channels=state["encoder.conv_out.weight"].shape[0] // 2)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    """x + conv(silu(norm(conv(silu(norm(x)))))), a 1×1 `nin_shortcut` on x when the width changes."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = group_norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the pixels, q/k/v/proj_out as 1×1 convolutions, residual."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (m(n).reshape(b, 1, c, h * w).transpose(2, 3) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """A stride-2 3×3 convolution after padding one row and column at the bottom/right (asymmetric, as FLUX's)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution: `block` res blocks, then `downsample` / `upsample` unless it is the last / first level."""

    def __init__(self, cin: int, cout: int, blocks: int, resample: type[nn.Module] | None, name: str):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout) for i in range(blocks))
        if resample is not None:
            setattr(self, name, resample(cout))
        self.resample = name if resample is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return getattr(self, self.resample)(x) if self.resample else x


class Encoder(nn.Module):
    def __init__(self, g: AutoencoderGeometry):
        super().__init__()
        widths = [g.ch * m for m in g.ch_mult]
        last = len(widths) - 1
        self.conv_in = nn.Conv2d(g.in_channels, g.ch, 3, padding=1)
        self.down = nn.ModuleList(
            Level(g.ch if i == 0 else widths[i - 1], w, g.num_res_blocks, None if i == last else Downsample, "downsample")
            for i, w in enumerate(widths))
        self.mid = Middle(widths[-1])
        self.norm_out = group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], 2 * g.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(self.mid(x))))


class Decoder(nn.Module):
    def __init__(self, g: AutoencoderGeometry):
        super().__init__()
        widths = [g.ch * m for m in g.ch_mult]
        self.conv_in = nn.Conv2d(g.z_channels, widths[-1], 3, padding=1)
        self.mid = Middle(widths[-1])
        # up[i] works at level i's width; it runs from the deepest level (i = last) up to level 0
        self.up = nn.ModuleList(
            Level(widths[min(i + 1, len(widths) - 1)], w, g.num_res_blocks + 1, None if i == 0 else Upsample,
                  "upsample") for i, w in enumerate(widths))
        self.norm_out = group_norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], g.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class FluxAutoencoder(nn.Module):
    def __init__(self, geometry: AutoencoderGeometry, scale_factor: float = SCALE_FACTOR,
                 shift_factor: float = SHIFT_FACTOR):
        super().__init__()
        self.geometry, self.scale_factor, self.shift_factor = geometry, scale_factor, shift_factor
        self.encoder, self.decoder = Encoder(geometry), Decoder(geometry)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [−1, 1] -> latents scale·(mean − shift) (the posterior mean: BAGEL samples it in training)."""
        mean = self.encoder(images).chunk(2, 1)[0]
        return self.scale_factor * (mean - self.shift_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents / self.scale_factor + self.shift_factor)
