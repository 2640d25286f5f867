"""Z-Image adapter (Z-Image and Z-Image-Turbo: a single-stream DiT over image and caption tokens + flow matching),
loaded from a local diffusers `ZImagePipeline` directory.

Latents: the VAE latent (B, C, H/8, W/8) (`AutoencoderKL`, C = 16 for the published one), the space the pipeline
draws its noise in; the transformer cuts 2×2 patches itself (it takes a list of (C, 1, h, w) tensors, one per
sample), so every sample keeps its own sequence length and no packing happens here.

Facts taken from diffusers' `ZImagePipeline` (0.42.1), which this adapter reproduces:
- Text: the prompt as one user turn of the tokenizer's chat template (generation prompt on, `enable_thinking=True`,
  which for Qwen3 adds no think block), padded to `max_sequence_length`, through the Qwen3 text encoder; the
  *second-to-last* hidden state (`hidden_states[-2]`) of the valid (unpadded) tokens. Each prompt keeps its own
  length: the transformer rounds each caption up to a multiple of 32 tokens with a learned pad token that is
  attended to, and masks only the padding between samples of a batch, so a sample's velocity does not depend on the
  prompts it is batched with.
- Timestep: the transformer takes 1 − σ, computed as (1000 − t)/1000 from t = 1000·σ (the scheduler's timestep).
- Velocity: the network predicts −v: v = −output (the pipeline negates before its Euler step).
- Guidance: CFG v = v_c + s·(v_c − v_u) with the pipeline's `guidance_scale` s (0: off; Z-Image-Turbo is
  distilled, s = 0; the negative prompt is "" by default); options: `cfg_normalization` c > 0 scales each guided
  sample down to ‖v‖ ≤ c·‖v_c‖ (norm over the whole sample), and `cfg_truncation` τ turns guidance off at the steps
  where (1000 − t)/1000 > τ (τ = 1: never).
- Sigmas: linspace(1, 1/N, N) through the scheduler's shift (its dynamic shift takes μ linear in the image token
  count, `calculate_shift`), then σ_N = 0.
- VAE: z = x / scaling_factor + shift_factor before decoding; (posterior mode − shift)·scale to encode.

Guidance in polyrl: `rollout.guidance_scale` is the CFG weight w of v_u + w·(v_c − v_u), 1 = off, as for every
other CFG model here; the pipeline's s is w − 1 (a recipe's `guidance_scale: 4` is w = 5). The normalisation and
truncation are functions of (x, σ), so the rollout and training compute the same guided velocity.
"""

from __future__ import annotations

import torch

from ..latents import Latents, MediaShape
from .base import Cond, Media, Prompt, image_latent_grid, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .options import read_options
from .qwen_image import pad_text, repad, shifted_sigmas

# Flow-Factory's Z-Image LoRA targets (models/z_image/z_image.py `default_target_modules`): attention q/k/v/out and
# the SwiGLU feed-forward of every block (the main layers and both refiners).
Z_IMAGE_LORA_TARGETS = [
    "attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
]
SEQ_MULTIPLE = 32  # the transformer pads the image and the caption sequences to multiples of 32 tokens
ADALN_DIM = 256  # the transformer's timestep-embedding width cap (ADALN_EMBED_DIM)
T_EMBED_HIDDEN = 1024  # its TimestepEmbedder's hidden width


# ----------------------------------------------------------------------------------------------- pure math
def padded_tokens(n: int) -> int:
    """A sequence of n tokens padded to the transformer's multiple of 32."""
    return -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE


def z_image_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """`ZImageTransformer2DModel`, one sample with `image_tokens` 2×2 patch tokens and `text_tokens` caption tokens
    (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·S²·d), each sequence padded to a multiple of 32
    (N', T'; the pad tokens are computed and attended to like the others), S = N' + T'.

    Every block has q/k/v/out (4d²) and a SwiGLU feed-forward d → h, d → h, h → d (3dh, h = ⌊8d/3⌋) per token and
    self-attention over its sequence: the noise refiner blocks on the N' image tokens, the context refiner blocks on
    the T' caption tokens, the main layers on all S. Modulated blocks (noise refiner, main) add an AdaLN linear
    a → 4d per sample (a = min(d, 256)). Plus x_embedder (4C → d) on N', cap_embedder (D_cap → d) on T', the final
    layer's d → 4C on all S tokens and its AdaLN a → d per sample, and the timestep embedder 256 → 1024 → a.
    """
    c = config
    d, p = c.dim, c.all_patch_size[0]
    hidden, a = int(d / 3 * 8), min(d, ADALN_DIM)
    patch_features = p * p * c.all_f_patch_size[0] * c.in_channels
    n, t = padded_tokens(image_tokens), padded_tokens(text_tokens)
    s = n + t

    def blocks(count: int, tokens: int, modulated: bool) -> int:
        per_block = 2 * tokens * (4 * d * d + 3 * d * hidden) + 4 * tokens * tokens * d
        return count * (per_block + (2 * a * 4 * d if modulated else 0))

    flops = blocks(c.n_refiner_layers, n, True) + blocks(c.n_refiner_layers, t, False) + blocks(c.n_layers, s, True)
    flops += 2 * n * patch_features * d + 2 * t * c.cap_feat_dim * d + 2 * s * d * patch_features
    flops += 2 * a * d + 2 * (256 * T_EMBED_HIDDEN + T_EMBED_HIDDEN * a)
    return float(flops)


def z_image_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, normalization: float) -> torch.Tensor:
    """ZImagePipeline's CFG on (B, ...) velocities: v = v_c + (w − 1)·(v_c − v_u) (w = `scale`, polyrl's CFG weight);
    with `normalization` c > 0, a sample whose ‖v‖ exceeds c·‖v_c‖ (norms over all its elements) is scaled to it."""
    guided = v_cond + (scale - 1.0) * (v_cond - v_uncond)
    if normalization > 0:
        dims = tuple(range(1, guided.ndim))
        cond_norm = torch.linalg.vector_norm(v_cond, dim=dims, keepdim=True)
        norm = torch.linalg.vector_norm(guided, dim=dims, keepdim=True)
        limit = cond_norm * normalization
        guided = torch.where(norm > limit, guided * (limit / norm), guided)
    return guided


def guided_steps(sigma: torch.Tensor, truncation: float, num_train_timesteps: int) -> torch.Tensor:
    """Which samples get CFG at their σ: (T − t)/T ≤ τ with t = T·σ in float32 (the pipeline's arithmetic, so that a
    σ on the boundary is decided the same way); τ > 1 never truncates."""
    if truncation > 1:
        return torch.ones_like(sigma, dtype=torch.bool)
    t = sigma.float() * num_train_timesteps
    return (num_train_timesteps - t) / num_train_timesteps <= truncation


# ----------------------------------------------------------------------------------------------- adapter
@register_model("z_image")
class ZImagePolicy(DiffusersPolicy):
    default_lora_targets = Z_IMAGE_LORA_TARGETS
    family = "Z-Image"
    # `model.options` keys and defaults: ZImagePipeline's call defaults (config validation refuses other keys)
    options = {
        "cfg_normalization": 0.0,  # c > 0: a guided velocity's norm is capped at c·‖v_c‖ per sample; 0: off
        "cfg_truncation": 1.0,  # guidance only where 1 − σ ≤ τ; 1: every step
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"))
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.num_train_timesteps = int(self.scheduler.config.get("num_train_timesteps", 1000))

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        """The valid tokens' second-to-last hidden states (L, D) float32 (padding happens per batch)."""
        (text,) = text_only([prompt], self.family)
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
        tok = self.tokenizer([chat], padding="max_length", max_length=self.max_sequence_length, truncation=True,
                             return_tensors="pt")
        mask = tok.attention_mask.to(self.device).bool()
        out = self.text_encoder(input_ids=tok.input_ids.to(self.device), attention_mask=mask, output_hidden_states=True)
        embeds = out.hidden_states[-2][0][mask[0]].float()
        if embeds.shape[0] == 0:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        return {"prompt_embeds": embeds}

    def _collate(self, conds: list[Cond]) -> Cond:
        """`prompt_embeds` (B, L, D) right-padded to the longest prompt of the call, `prompt_mask` (B, L) bool."""
        embeds, mask = pad_text([c["prompt_embeds"] for c in conds])
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.vae_scale_factor  # × the transformer's 2×2 patches for the size check
        return {"x": (self.transformer.config.in_channels, *image_latent_grid(self.family, shape, f, 2 * f))}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The pipeline's grid: μ from the image token count (used when the scheduler shifts dynamically)."""
        _, h, w = self.latent_shapes(shape)["x"]
        return shifted_sigmas(self.scheduler, num_steps, (h // 2) * (w // 2))

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """The mean over the batch's samples (their caption lengths may differ; the batch padding is not counted)."""
        h, w = latents["x"].shape[-2:]
        lengths = cond["prompt_mask"].sum(1).tolist()
        return sum(z_image_forward_flops(self.transformer.config, (h // 2) * (w // 2), int(n)) for n in lengths) / len(lengths)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on (B, C, h, w) latents: one (C, 1, h, w) tensor and its valid caption tokens per sample."""
        x = latents["x"]
        t = sigma.float() * self.num_train_timesteps
        captions = [e[m].to(self.dtype) for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        out = network(list(x.float().to(self.dtype).unsqueeze(2).unbind(0)),
                      (self.num_train_timesteps - t) / self.num_train_timesteps, captions, return_dict=False)[0]
        return {"x": -torch.stack([o.float() for o in out]).squeeze(2)}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The conditional velocity, or CFG (`z_image_guidance`) for the samples whose σ is inside the truncation:
        one forward of the batch ⊕ those samples with the negative prompt."""
        if not shared or guidance == 1.0:
            return self._forward(latents, sigma, cond)
        guided = guided_steps(sigma, self.opts["cfg_truncation"], self.num_train_timesteps).to(sigma.device)
        index = guided.nonzero().flatten()
        if index.numel() == 0:
            return self._forward(latents, sigma, cond)
        b, k = sigma.shape[0], index.numel()
        length = max(cond["prompt_embeds"].shape[1], shared["prompt_embeds"].shape[1])
        pos = repad(cond, length)
        neg = {name: v.expand(k, *v.shape[1:]) for name, v in repad(shared, length).items()}
        both = self._forward({name: torch.cat([v, v[index]]) for name, v in latents.items()},
                             torch.cat([sigma, sigma[index]]), {name: torch.cat([pos[name], neg[name]]) for name in pos})
        out = {}
        for name, v in both.items():
            v_cond, v_uncond = v[:b], v[b:]
            mixed = v_cond.clone()
            mixed[index] = z_image_guidance(v_cond[index], v_uncond, guidance, self.opts["cfg_normalization"])
            out[name] = mixed
        return out

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        cfg = self.vae.config
        z = latents["x"].to(self.device, torch.float32) / cfg.scaling_factor + cfg.shift_factor
        return {"images": (self.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        cfg = self.vae.config
        z = self.vae.encode(media["images"].to(self.device, torch.float32) * 2 - 1).latent_dist.mode()
        return {"x": (z - cfg.shift_factor) * cfg.scaling_factor}
