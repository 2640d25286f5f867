"""FLUX.2 adapter (dev and Klein layouts), loaded from a local diffusers `Flux2Pipeline` / `Flux2KleinPipeline`
directory; the pipeline class in model_index.json says which layout it is.

Latents: FLUX.2's VAE (`AutoencoderKLFlux2`, 32 channels) is followed by a 2×2 patchify to 128 channels and a
batch-norm normalisation, and the pipeline draws its noise in that space: (B, 4C, H/16, W/16). That is polyrl's
latent here, so every latent pixel is one transformer token (packing is a reshape to (B, h·w, 4C), row-major) and
the initial noise can be handed to the pipeline unchanged.

Facts taken from diffusers' `Flux2Pipeline` and `Flux2KleinPipeline` (0.42.1), which this adapter reproduces:
- Layouts: `Flux2KleinPipeline` (`is_distilled` in model_index.json: the step-distilled Klein), `Flux2KleinKVPipeline`
  (a step-distilled Klein) and `Flux2Pipeline` (dev).
- Text, Klein: Qwen3 over the chat template (one user turn, generation prompt, thinking off), padded to
  `max_sequence_length`; the hidden states of layers 9, 18 and 27 are stacked on the feature axis (3·H per
  token). dev: Mistral-Small-3 over the system prompt + user turn (`format_input`), layers 10, 20 and 30. Every
  padded token is kept (no text mask in the transformer).
- Ids: four coordinates (t, h, w, l): image tokens (0, i, j, 0), text tokens (0, 0, 0, k).
- Timestep: σ itself (the transformer multiplies by 1000).
- Guidance: dev is guidance-distilled (`guidance_embeds=True`): `Guidance.scale` is the embedding, one forward.
  Klein base: CFG with a negative prompt (the pipeline's is ""), v_u + s·(v_c − v_u), on when the scale is > 1.
  Klein distilled (`is_distilled`): no guidance.
- Sigmas: linspace(1, 1/N, N) through the scheduler's exponential shift with FLUX.2's empirical μ, which depends on
  the token count *and* the step count (`flux2_empirical_mu`), then σ_N = 0.
- VAE: x·√(running_var + eps) + running_mean (the VAE's batch-norm statistics), un-patchify, decode; the inverse to
  encode (posterior mode).

Not covered: FLUX.2's reference-image conditioning (the pipelines' `image=`); prompts carrying images are refused.
"""

from __future__ import annotations

import numpy as np
import torch

from ..latents import Latents, MediaShape
from .base import Cond, Guidance, Media, Prompt, image_latent_grid, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen, load_model_index

# Flow-Factory's FLUX.2 LoRA targets (models/flux/flux2_klein.py `default_target_modules`): both streams' attention
# q/k/v/out and feed-forward layers of the double-stream blocks, and the single-stream blocks' fused q/k/v + MLP
# input projection (Flow-Factory's "attn.to_out.0" matches only the double-stream blocks: the single-stream fused
# output projection is not trained, here either).
FLUX2_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
]
# The text encoder layers whose hidden states make the text tokens (the pipelines' `text_encoder_out_layers`).
KLEIN_TEXT_LAYERS = (9, 18, 27)
DEV_TEXT_LAYERS = (10, 20, 30)
# pipeline class -> layout; Flux2KleinKVPipeline (FLUX.2-klein-9b-kv) is a step-distilled Klein whose reference-image
# K/V caching changes nothing for text-to-image
LAYOUTS = {"Flux2KleinPipeline": "klein", "Flux2KleinKVPipeline": "klein", "Flux2Pipeline": "dev"}


# ----------------------------------------------------------------------------------------------- pure math
def flux2_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """FLUX.2 transformer (`Flux2Transformer2DModel`), one sample with `image_tokens` latent tokens and
    `text_tokens` text tokens (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·S²·d over S = N + T).

    With r = mlp_ratio (3): per double-stream block, each stream's q/k/v/out (4d²) and SwiGLU feed-forward
    (d → 2rd, rd → d: 3rd²) on its own tokens, and the joint attention; per single-stream block, on all N + T
    tokens, the fused q/k/v + MLP input d → (3 + 2r)d and the fused output (1 + r)d → d, so (4 + 3r)d² per token as
    well, and the attention. The modulation is shared by all blocks: computed once per sample (d → 6d for each
    double stream, d → 3d single), with the time (and guidance) embedders 256 → d → d and the output
    AdaLayerNormContinuous d → 2d. Plus x_embedder (C_in → d) and proj_out (d → C_out) on the image tokens only
    (the text tokens are dropped before the output), context_embedder (joint → d) on the text tokens.
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, s = image_tokens, text_tokens, image_tokens + text_tokens
    per_token = (4 + 3 * c.mlp_ratio) * d * d
    out_channels = c.out_channels or c.in_channels
    flops = 2 * n * c.in_channels * d + 2 * t * c.joint_attention_dim * d + 2 * n * d * c.patch_size**2 * out_channels
    flops += (c.num_layers + c.num_single_layers) * (2 * s * per_token + 4 * s * s * d)
    embedders = (2 if c.guidance_embeds else 1) * (c.timestep_guidance_channels * d + d * d)
    per_sample = 2 * embedders + 2 * d * (6 * d + 6 * d + 3 * d) + 2 * d * 2 * d
    return float(flops + per_sample)


def flux2_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's μ of the time shift (black-forest-labs/flux2 `sampling.py`, diffusers' `compute_empirical_mu`): two
    lines in the token count N, m_200(N) = 1.6927e-4·N + 0.45667 and m_10(N) = 8.7381e-5·N + 1.89833, interpolated
    linearly in the step count between 10 and 200 steps; beyond N = 4300 tokens m_200(N) alone."""
    m_200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    slope = (m_200 - m_10) / 190.0
    return float(slope * num_steps + m_200 - 200.0 * slope)


def token_ids(rows: int, cols: int) -> torch.Tensor:
    """(rows·cols, 4) position ids (t, h, w, l) = (0, i, j, 0) of a latent grid, row-major."""
    i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    zero = torch.zeros_like(i)
    return torch.stack([zero, i, j, zero], -1).reshape(-1, 4)


def text_ids(length: int) -> torch.Tensor:
    """(length, 4) position ids (0, 0, 0, k) of the text tokens."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids


def patchify(z: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) -> (B, 4C, h, w): channel c·4 + 2r + s of pixel (i, j) is z[c, 2i + r, 2j + s]."""
    b, c, h, w = z.shape
    return z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`: (B, 4C, h, w) -> (B, C, 2h, 2w)."""
    b, c4, h, w = x.shape
    return x.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


# ----------------------------------------------------------------------------------------------- adapter
@register_model("flux2")
class Flux2Policy(DiffusersPolicy):
    default_lora_targets = FLUX2_LORA_TARGETS
    family = "FLUX.2"

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"))
        index = load_model_index(self.root)
        self.layout = LAYOUTS.get(index.get("_class_name"))
        if self.layout is None:
            raise ValueError(f"{self.root}: model_index.json names {index.get('_class_name')!r}; a FLUX.2 checkpoint "
                             f"is one of {', '.join(LAYOUTS)}")
        # the KV pipeline never guides (its is_distilled defaults to true)
        self.is_distilled = bool(index.get("is_distilled", index["_class_name"] == "Flux2KleinKVPipeline"))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        # FLUX.2-dev's tokenizer component is a PixtralProcessor, which cannot be built without torchvision; only its
        # tokenizer (with the chat template) encodes text
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.root / "tokenizer"))
        self.text_layers = DEV_TEXT_LAYERS if self.layout == "dev" else KLEIN_TEXT_LAYERS
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        bn = self.vae.bn
        self._bn_mean = bn.running_mean.float().view(1, -1, 1, 1)
        self._bn_std = torch.sqrt(bn.running_var.float().view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    # ------------------------------------------------------------------------------------------- prompts
    def _chat_tokens(self, text: str):
        """The prompt in the layout's chat template, tokenized and padded to max_sequence_length."""
        length = self.max_sequence_length
        if self.layout == "dev":
            from diffusers.pipelines.flux2.pipeline_flux2 import format_input
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

            return self.tokenizer.apply_chat_template(
                format_input(prompts=[text], system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
                tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
                max_length=length)
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)
        return self.tokenizer(chat, return_tensors="pt", padding="max_length", truncation=True, max_length=length)

    def _encode_one(self, prompt: Prompt) -> Cond:
        """(max_sequence_length, 3·H) float32: the stacked hidden states of the layout's three layers."""
        (text,) = text_only([prompt], self.family)
        tok = self._chat_tokens(text)
        out = self.text_encoder(input_ids=tok["input_ids"].to(self.device),
                                attention_mask=tok["attention_mask"].to(self.device), output_hidden_states=True,
                                use_cache=False)
        layers = torch.stack([out.hidden_states[k][0] for k in self.text_layers], 1)  # (L, 3, H)
        return {"prompt_embeds": layers.reshape(layers.shape[0], -1).float()}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """Klein base: the negative prompt's conditioning when the scale is > 1 (CFG); dev (embedded guidance):
        nothing. A distilled Klein has no guidance and refuses a scale."""
        if self.guidance_embeds:
            return {}
        if self.is_distilled:
            if guidance.scale != 1.0:
                raise ValueError(f"a step-distilled {self.family} Klein has no guidance: rollout.guidance_scale="
                                 f"{guidance.scale} must be 1.0")
            return {}
        return self.encode_prompts([guidance.negative_prompt]) if guidance.scale > 1.0 else {}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.vae_scale_factor * 2  # VAE downsampling × 2×2 patchify (the latents are patchified)
        return {"x": (self.transformer.config.in_channels, *image_latent_grid(self.family, shape, f, f))}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The pipeline's grid: μ from the token count and the step count."""
        _, h, w = self.latent_shapes(shape)["x"]
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps),
                                     mu=flux2_empirical_mu(h * w, num_steps))
        return self.scheduler.sigmas.float().cpu()

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        h, w = latents["x"].shape[-2:]
        return flux2_forward_flops(self.transformer.config, h * w, cond["prompt_embeds"].shape[1])

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on (B, 4C, h, w) latents: one token per latent pixel, row-major."""
        x = latents["x"]
        b, c, h, w = x.shape
        embeds = cond["prompt_embeds"]
        guidance = cond.get("guidance")
        out = network(
            hidden_states=x.float().flatten(2).transpose(1, 2).to(self.dtype),
            timestep=sigma.float(),  # σ, not 1000·σ: the transformer scales by 1000 itself
            guidance=None if guidance is None else guidance.float(),
            encoder_hidden_states=embeds.to(self.dtype),
            txt_ids=text_ids(embeds.shape[1]).to(x.device),
            img_ids=token_ids(h, w).to(x.device),
            return_dict=False,
        )[0]
        return {"x": out.float().transpose(1, 2).reshape(b, c, h, w)}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """dev: `guidance` is the embedding (one forward); Klein: CFG as `DiffusersPolicy` does it."""
        if not self.guidance_embeds:
            return super().velocity(latents, sigma, cond, shared, guidance)
        b = cond["prompt_embeds"].shape[0]
        scale = torch.full((b,), float(guidance), device=cond["prompt_embeds"].device)
        return self._forward(latents, sigma, {**cond, "guidance": scale})

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        x = latents["x"].to(self.device, torch.float32)
        z = unpatchify(x * self._bn_std.to(x.device) + self._bn_mean.to(x.device))
        return {"images": (self.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        z = self.vae.encode(media["images"].to(self.device, torch.float32) * 2 - 1).latent_dist.mode()
        return {"x": (patchify(z) - self._bn_mean.to(z.device)) / self._bn_std.to(z.device)}
