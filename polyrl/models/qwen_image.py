"""Qwen-Image adapter (dual-stream MM-DiT + flow matching), loaded from a local diffusers directory.

The transformer works on *packed* latents: the VAE latent (C, h, w) is cut into 2×2 patches, giving h/2·w/2
tokens of 4C features. The sampler and the stored trajectories use the *unpacked* (B, C, h, w) latents like
every other adapter; packing happens inside `velocity`. The transformer's output, unpacked, is the flow velocity
v ≈ ε − x0 that FlowMatchEuler integrates as x_{σ'} = x + (σ' − σ)·v (polyrl's convention, ALGORITHMS.md).

Facts taken from diffusers' `QwenImagePipeline` (0.42.1), which this adapter reproduces:
- Text: the prompt is wrapped in a chat template and encoded by Qwen2.5-VL; the last hidden state of the valid
  tokens is kept, minus the template's first 34 tokens (system prompt + user header), truncated to
  `max_sequence_length`. Prompts of different lengths are right-padded with zeros and a mask.
- Timestep: the transformer takes σ itself (its sinusoidal embedding multiplies by 1000 internally).
- Sigmas: linspace(1, 1/N, N) through the scheduler's dynamic shift with μ from the image token count
  (`dynamic_shift_mu`), then the scheduler's terminal stretch; σ_N = 0 appended.
- CFG: "true CFG" with norm rescale per packed token (`true_cfg`), in rollout and in training alike.
- VAE: `AutoencoderKLQwenImage` works on videos (B, C, T, H, W): one frame; latents are normalised with the
  per-channel latents_mean / latents_std of its config.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..perf.flops import qwen_image_forward_flops
from .base import Cond, register_model
from .sd3 import _DTYPES, _load_component, pipeline_components

# The template Qwen-Image was trained with, and the number of its leading tokens that are dropped (the system
# prompt and user header); both are the model's, not polyrl's choice.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024  # prompt tokens after the dropped header

QWEN_IMAGE_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
]


# ----------------------------------------------------------------------------------------------- pure math
def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2·w/2, 4C): token (i, j) holds the 2×2 patch at rows 2i..2i+1, cols 2j..2j+1, features
    ordered (channel, row in patch, col in patch)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents`: (B, h/2·w/2, 4C) -> (B, C, h, w) for a latent grid of `height`×`width`."""
    b, n, f = tokens.shape
    if n != (height // 2) * (width // 2):
        raise ValueError(f"{n} tokens do not tile a {height}x{width} latent in 2x2 patches")
    x = tokens.reshape(b, height // 2, width // 2, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, height, width)


def true_cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float, dim: int = -1) -> torch.Tensor:
    """Qwen-Image's true CFG (ALGORITHMS.md §1, CFG): comb = v_u + s·(v_c − v_u), rescaled so that every token's
    norm over `dim` equals v_c's: comb·‖v_c‖/‖comb‖ (on packed latents `dim` is the 4C patch features)."""
    comb = v_uncond + scale * (v_cond - v_uncond)
    cond_norm = torch.linalg.vector_norm(v_cond, dim=dim, keepdim=True)
    comb_norm = torch.linalg.vector_norm(comb, dim=dim, keepdim=True)
    return comb * (cond_norm / comb_norm.clamp_min(torch.finfo(comb.dtype).tiny))


def dynamic_shift_mu(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """μ of the resolution-dependent shift: linear in the image token count, base_shift at base_seq_len and
    max_shift at max_seq_len (extrapolated beyond)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def pad_text(embeds: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, D) token embeddings with zeros to a common length: (B, L, D) and a bool mask (B, L)."""
    length = max(e.shape[0] for e in embeds) if length is None else length
    out = torch.stack([F.pad(e, (0, 0, 0, length - e.shape[0])) for e in embeds])
    mask = torch.stack([torch.arange(length, device=e.device) < e.shape[0] for e in embeds])
    return out, mask


def _repad(cond: Cond, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    e, m = cond["prompt_embeds"], cond["prompt_mask"]
    extra = length - e.shape[1]
    return F.pad(e, (0, 0, 0, extra)), F.pad(m, (0, extra), value=False)


# ----------------------------------------------------------------------------------------------- adapter
@register_model("qwen_image")
class QwenImageAdapter:
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS

    def __init__(self, cfg, device: torch.device):
        root = Path(cfg.path)
        present = pipeline_components(root, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"), "Qwen-Image")
        dtype = _DTYPES[cfg.dtype]
        self.device, self.dtype = device, dtype
        self.transformer = _load_component(root, "transformer", present["transformer"], dtype).to(device)
        self.vae = _load_component(root, "vae", present["vae"], torch.float32).to(device).eval().requires_grad_(False)
        self.scheduler = _load_component(root, "scheduler", present["scheduler"], None)
        self.text_encoder = _load_component(root, "text_encoder", present["text_encoder"], dtype).to(device)
        self.text_encoder.eval().requires_grad_(False)
        self.tokenizer = _load_component(root, "tokenizer", present["tokenizer"], None)
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** len(self.vae.config.temperal_downsample)
        self._cache: dict[str, torch.Tensor] = {}  # prompt -> (L, D) float32 valid-token embeddings
        self.flops = 0.0  # model FLOPs executed so far (ALGORITHMS.md §6); the trainer reads and resets it

    # ------------------------------------------------------------------------------------------- prompts
    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        tok = self.tokenizer(texts, max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP, padding=True, truncation=True,
                             return_tensors="pt").to(self.device)
        out = self.text_encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True)
        hidden = out.hidden_states[-1].float()
        valid = tok.attention_mask.bool()
        return [h[m][TEMPLATE_DROP:][: self.max_sequence_length] for h, m in zip(hidden, valid, strict=True)]

    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Text conditioning, cached per prompt (the text encoder is frozen): `prompt_embeds` (B, L, D) float32
        right-padded to the longest prompt of the call, `prompt_mask` (B, L) bool."""
        # one prompt per encoder call, so an embedding does not depend on the batch it arrived in (exact resume)
        for p in sorted({p for p in prompts if p not in self._cache}):
            for e in self._encode_uncached([p]):
                if e.shape[0] == 0:
                    raise ValueError(f"prompt {p!r} encodes to no tokens after the template's first {TEMPLATE_DROP}")
                self._cache[p] = e
        embeds, mask = pad_text([self._cache[p] for p in prompts])
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    # ------------------------------------------------------------------------------------------- diffusion
    def _latent_grid(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor * 2  # VAE downsampling × 2×2 packing
        if height % f or width % f:
            raise ValueError(f"rollout.height/width must be multiples of {f} for Qwen-Image, got {height}x{width}")
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def initial_noise(self, batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        h, w = self._latent_grid(height, width)
        shape = (batch, self.transformer.config.out_channels, h, w)
        return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(self.device)

    def sigmas(self, num_steps: int, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """The grid the pipeline samples `height`×`width` images with (the shift depends on the image size)."""
        if height is None or width is None:
            raise ValueError("Qwen-Image sigmas depend on the image size (dynamic shift): call sigmas(num_steps, "
                             "height, width)")
        h, w = self._latent_grid(height, width)
        c = self.scheduler.config
        mu = dynamic_shift_mu((h // 2) * (w // 2), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                              c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().cpu()

    def _forward(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor, embeds: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = tokens.shape
        per_sample = qwen_image_forward_flops(self.transformer.config, n, embeds.shape[1])
        self.flops += per_sample * b * (3 if torch.is_grad_enabled() else 1)
        # bf16/fp16 weights: autocast runs float32 LoRA weights and inputs in the same low precision
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.transformer(
                hidden_states=tokens.to(self.dtype),
                timestep=sigma.float(),  # σ, not 1000·σ: the embedding scales by 1000 itself
                encoder_hidden_states=embeds.to(self.dtype),
                encoder_hidden_states_mask=mask,
                img_shapes=[[(1, grid[0] // 2, grid[1] // 2)]] * b,
                return_dict=False,
            )[0]
        return out.float()

    def velocity(self, latents, sigma, cond: Cond, neg: Cond | None, guidance: float) -> torch.Tensor:
        """v on unpacked latents; with CFG, uncond and cond run as one batch (text padded to a common length)."""
        grid = tuple(latents.shape[-2:])
        tokens = pack_latents(latents.float())
        if neg is None or guidance == 1.0:
            embeds, mask = cond["prompt_embeds"], cond["prompt_mask"]
            v = self._forward(tokens, grid, sigma, embeds, None if mask.all() else mask)
            return unpack_latents(v, *grid)
        length = max(cond["prompt_embeds"].shape[1], neg["prompt_embeds"].shape[1])
        (e_u, m_u), (e_c, m_c) = _repad(neg, length), _repad(cond, length)
        mask = torch.cat([m_u, m_c])
        v_u, v_c = self._forward(torch.cat([tokens, tokens]), grid, torch.cat([sigma, sigma]), torch.cat([e_u, e_c]),
                                 None if mask.all() else mask).chunk(2)
        return unpack_latents(true_cfg(v_u, v_c, guidance), *grid)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        z = latents.float().unsqueeze(2) * std + mean  # (B, C, 1, h, w): one video frame
        return (self.vae.decode(z, return_dict=False)[0][:, :, 0] / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        z = self.vae.encode(images.to(self.device).float().unsqueeze(2) * 2 - 1).latent_dist.mean[:, :, 0]
        mean = torch.tensor(cfg.latents_mean, device=z.device).view(1, -1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device).view(1, -1, 1, 1)
        return (z - mean) / std
