"""Qwen-Image adapter (dual-stream MM-DiT + flow matching), loaded from a local diffusers directory.

The transformer works on *packed* latents: the VAE latent (C, h, w) is cut into 2×2 patches, giving h/2·w/2
tokens of 4C features. The sampler and the stored trajectories use the *unpacked* (B, C, h, w) latents like
every other adapter; packing happens inside `velocity`. The transformer's output, unpacked, is the flow velocity
v ≈ ε − x0 that FlowMatchEuler integrates as x_{σ'} = x + (σ' − σ)·v (polyrl's convention, docs/algorithms.md §1).

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

import numpy as np
import torch
import torch.nn.functional as F

from ..latents import Latents, MediaShape
from .base import Cond, Media, Prompt, image_latent_grid, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen

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
def qwen_image_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """Qwen-Image dual-stream MM-DiT (`QwenImageTransformer2DModel`), one sample with `image_tokens` packed 2×2
    patches and `text_tokens` (padded) text tokens (docs/algorithms.md §6).

    Per block, each stream has its own q/k/v/out (4d²) and GELU MLP (d → 4d → d, 8d²) applied to its own tokens,
    and the joint attention runs over N+T tokens; the per-sample modulation linears are img_mod and txt_mod
    (d → 6d each). Plus img_in (4C → d), txt_in (joint → d), the timestep embedder (256 → d → d), the output
    AdaLayerNormContinuous (d → 2d) and proj_out (d → 4·C_out).
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, layers = image_tokens, text_tokens, c.num_layers
    p2 = c.patch_size**2
    per_sample = 2 * (256 * d + d * d) + 2 * d * 2 * d + layers * 2 * (2 * d * 6 * d)
    flops = 2 * n * c.in_channels * d + 2 * t * c.joint_attention_dim * d + 2 * n * d * p2 * c.out_channels
    flops += layers * (2 * (n + t) * 12 * d * d + 4 * (n + t) ** 2 * d)
    return float(flops + per_sample)


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
    """Qwen-Image's true CFG (docs/algorithms.md §1, CFG): comb = v_u + s·(v_c − v_u), rescaled so that every token's
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


def shifted_sigmas(scheduler, num_steps: int, image_tokens: int) -> torch.Tensor:
    """The grid of the pipelines whose shift depends on the image size (Qwen-Image, FLUX.1, Z-Image): σ from 1 to
    1/N, shifted by μ = `dynamic_shift_mu` of the image token count with the scheduler's config (a scheduler without
    dynamic shifting ignores μ), then the final 0."""
    c = scheduler.config
    mu = dynamic_shift_mu(image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                          c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.float().cpu()


def pad_text(embeds: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, D) token embeddings with zeros to a common length: (B, L, D) and a bool mask (B, L)."""
    length = max(e.shape[0] for e in embeds) if length is None else length
    out = torch.stack([F.pad(e, (0, 0, 0, length - e.shape[0])) for e in embeds])
    mask = torch.stack([torch.arange(length, device=e.device) < e.shape[0] for e in embeds])
    return out, mask


def repad(cond: Cond, length: int) -> Cond:
    """Text conditioning right-padded (zeros, mask False) to `length` tokens."""
    e, m = cond["prompt_embeds"], cond["prompt_mask"]
    extra = length - e.shape[1]
    return {"prompt_embeds": F.pad(e, (0, 0, 0, extra)), "prompt_mask": F.pad(m, (0, extra), value=False)}


# ----------------------------------------------------------------------------------------------- adapter
@register_model("qwen_image")
class QwenImagePolicy(DiffusersPolicy):
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS
    family = "Qwen-Image"

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** len(self.vae.config.temperal_downsample)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        """The valid-token embeddings (L, D) float32 of one prompt (padding happens per batch, in `_collate`)."""
        (text,) = text_only([prompt], self.family)
        tok = self.tokenizer([PROMPT_TEMPLATE.format(text)], max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP,
                             padding=True, truncation=True, return_tensors="pt").to(self.device)
        out = self.text_encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True)
        hidden = out.hidden_states[-1].float()[0][tok.attention_mask[0].bool()]
        embeds = hidden[TEMPLATE_DROP:][: self.max_sequence_length]
        if embeds.shape[0] == 0:
            raise ValueError(f"prompt {text!r} encodes to no tokens after the template's first {TEMPLATE_DROP}")
        return {"prompt_embeds": embeds}

    def _collate(self, conds: list[Cond]) -> Cond:
        """`prompt_embeds` (B, L, D) right-padded to the longest prompt of the call, `prompt_mask` (B, L) bool."""
        embeds, mask = pad_text([c["prompt_embeds"] for c in conds])
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.vae_scale_factor  # × the 2×2 packing for the size check
        return {"x": (self.transformer.config.out_channels, *image_latent_grid(self.family, shape, f, 2 * f))}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The grid the pipeline samples this image size with (the shift depends on the image size)."""
        _, h, w = self.latent_shapes(shape)["x"]
        return shifted_sigmas(self.scheduler, num_steps, (h // 2) * (w // 2))

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        h, w = latents["x"].shape[-2:]
        return qwen_image_forward_flops(self.transformer.config, (h // 2) * (w // 2), cond["prompt_embeds"].shape[1])

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on unpacked latents: packs 2×2 patches, runs the transformer, unpacks."""
        x = latents["x"]
        grid = tuple(x.shape[-2:])
        mask = cond["prompt_mask"]
        out = network(
            hidden_states=pack_latents(x.float()).to(self.dtype),
            timestep=sigma.float(),  # σ, not 1000·σ: the embedding scales by 1000 itself
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=None if mask.all() else mask,
            img_shapes=[[(1, grid[0] // 2, grid[1] // 2)]] * x.shape[0],
            return_dict=False,
        )[0]
        return {"x": unpack_latents(out.float(), *grid)}

    def _pair(self, cond: Cond, shared: Cond) -> Cond:
        """uncond ⊕ cond with the text of both padded to a common length."""
        b = cond["prompt_embeds"].shape[0]
        length = max(cond["prompt_embeds"].shape[1], shared["prompt_embeds"].shape[1])
        neg = {k: v.expand(b, *v.shape[1:]) for k, v in repad(shared, length).items()}
        pos = repad(cond, length)
        return {k: torch.cat([neg[k], pos[k]]) for k in pos}

    def _guide(self, uncond: Latents, cond: Latents, scale: float) -> Latents:
        """True CFG with the norm rescale per packed token (the pipeline's form, in rollout and training)."""
        grid = tuple(cond["x"].shape[-2:])
        return {"x": unpack_latents(true_cfg(pack_latents(uncond["x"]), pack_latents(cond["x"]), scale), *grid)}

    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        cfg = self.vae.config
        x = latents["x"]
        mean = torch.tensor(cfg.latents_mean, device=x.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=x.device).view(1, -1, 1, 1, 1)
        z = x.float().unsqueeze(2) * std + mean  # (B, C, 1, h, w): one video frame
        return {"images": (self.vae.decode(z, return_dict=False)[0][:, :, 0] / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        cfg = self.vae.config
        images = media["images"]
        z = self.vae.encode(images.to(self.device).float().unsqueeze(2) * 2 - 1).latent_dist.mean[:, :, 0]
        mean = torch.tensor(cfg.latents_mean, device=z.device).view(1, -1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device).view(1, -1, 1, 1)
        return {"x": (z - mean) / std}
