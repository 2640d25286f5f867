"""FLUX.1 (dev, schnell) and FLUX.1-Kontext adapters (MM-DiT with double- and single-stream blocks + flow matching),
loaded from a local diffusers `FluxPipeline` / `FluxKontextPipeline` directory.

Latents: the unpacked VAE latent (B, C, h, w) (C = 16 for the published VAE, h, w = H/8, W/8), as for Qwen-Image.
The transformer works on *packed* latents, 2×2 patches of 4C features (the same packing as Qwen-Image's,
`pack_latents`), with a position id (0, row, column) per patch token and (0, 0, 0) per text token; packing and ids
stay inside `_network_forward`. Unpacked latents keep the sampler, the stored trajectories and `encode_media` the
same for every image family; the packed form would save nothing, since each network call packs exactly once.

Facts taken from diffusers' `FluxPipeline` and `FluxKontextPipeline` (0.42.1), which these adapters reproduce:
- Text: CLIP's pooled output (`pooler_output`, the prompt padded to the CLIP tokenizer's max length) and T5's last
  hidden state of the prompt padded to `max_sequence_length` (pad tokens included: FLUX has no text mask).
- Timestep: σ itself (the pipeline passes t/1000 = σ; the transformer multiplies by 1000 inside).
- Guidance: FLUX.1-dev is guidance-distilled: the scale enters the transformer as an embedding (`guidance`, also
  ×1000 inside), one forward per step; schnell (`guidance_embeds=False`) has no guidance. Optional true CFG with
  a negative prompt (`true_cfg_scale` > 1): v = v_neg + s·(v_pos − v_neg), both with the same embedded guidance.
- Sigmas: linspace(1, 1/N, N) through the scheduler's shift, μ linear in the noise-token count (`calculate_shift`;
  dev: exponential time shift with μ, schnell: no dynamic shift), then σ_N = 0.
- VAE: z = x / scaling_factor + shift_factor before decoding; the posterior mode, (z − shift)·scale, to encode.
- Kontext: the condition image is VAE-encoded, packed and concatenated after the noise tokens along the sequence,
  its ids (1, row, column); the output on the condition tokens is dropped. μ counts the noise tokens only.

Guidance in polyrl: `Guidance.scale` is the embedded guidance (dev, Kontext; schnell has none and refuses a scale
other than 1); true CFG is a model setting, `model.true_cfg_scale` (> 1 turns it on, for every variant; the negative
prompt is `rollout.negative_prompt`), because the rollout carries one scale and FLUX.1-dev can use both at once.
True CFG is then part of the model's velocity everywhere: the `guidance=1.0` calls of `diffusion_nft` /
`diffusion_dpo` ("no guidance") change only the embedding (to 1), as a guidance-distilled model has no unguided form.
"""

from __future__ import annotations

import torch

from ..latents import Latents, MediaShape
from .base import Cond, Guidance, Media, Prompt, image_latent_grid, register_model, text_only
from .condition_images import condition_paths, load_rgb
from .diffusers_base import DiffusersPolicy, frozen
from .qwen_image import pack_latents, shifted_sigmas, unpack_latents

# flow_grpo's FLUX LoRA targets (scripts/train_flux.py): attention q/k/v/out of both streams (q/k/v also match the
# single-stream blocks' attention) and both streams' feed-forward layers; Kontext adds the single-stream MLP input
# (scripts/train_flux_kontext.py). The single-stream output projection (`proj_out`) is in neither list.
FLUX_LORA_TARGETS = [
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]
FLUX_KONTEXT_LORA_TARGETS = [*FLUX_LORA_TARGETS, "proj_mlp"]
MAX_T5_TOKENS = 512  # FluxPipeline refuses longer prompts

# The resolutions Kontext was trained at (diffusers' PREFERRED_KONTEXT_RESOLUTIONS, each ≈ 1024² px): the pipeline
# resizes a condition image to the one nearest its aspect ratio.
KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)
KONTEXT_PUBLISHED_SIZE = 1024


# ----------------------------------------------------------------------------------------------- pure math
def flux_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """FLUX.1 transformer (`FluxTransformer2DModel`), one sample with `image_tokens` packed tokens (Kontext: noise +
    condition tokens) and `text_tokens` T5 tokens (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention
    4·S²·d over the joint sequence S = N + T).

    Per double-stream block: each stream's q/k/v/out (4d²) and GELU MLP d → 4d → d (8d²) on its own tokens, so
    12d² per token of N + T, and the joint attention; per-sample AdaLN-Zero linears d → 6d for each stream. Per
    single-stream block, on all N + T tokens: q/k/v (3d²), the MLP input d → 4d (4d²) and the fused output
    (d + 4d) → d (5d²), also 12d² per token, and the attention; a per-sample AdaLN linear d → 3d. Plus x_embedder
    (4C → d) and proj_out (d → 4C) on the image tokens, context_embedder (joint → d) on the text tokens, and per
    sample the time and guidance embedders (256 → d → d each), the pooled-text embedder (pooled → d → d) and the
    output AdaLayerNormContinuous (d → 2d).
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, s = image_tokens, text_tokens, image_tokens + text_tokens
    out_channels = c.out_channels or c.in_channels
    flops = 2 * n * c.in_channels * d + 2 * t * c.joint_attention_dim * d + 2 * n * d * c.patch_size**2 * out_channels
    flops += (c.num_layers + c.num_single_layers) * (2 * s * 12 * d * d + 4 * s * s * d)
    embedders = (2 if c.guidance_embeds else 1) * (256 * d + d * d) + c.pooled_projection_dim * d + d * d
    per_sample = 2 * embedders + c.num_layers * 2 * (2 * d * 6 * d) + c.num_single_layers * 2 * d * 3 * d
    per_sample += 2 * d * 2 * d
    return float(flops + per_sample)


def image_ids(rows: int, cols: int, frame: int = 0) -> torch.Tensor:
    """(rows·cols, 3) float32 position ids of a packed token grid, row-major: (frame, i, j) for the token at row i,
    column j (FLUX.1's `_prepare_latent_image_ids`; Kontext gives its condition frame 1)."""
    i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.full_like(i, frame), i, j], -1).reshape(-1, 3).float()


def kontext_condition_dims(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) a Kontext condition image is resized to: the trained resolution (w_r, h_r) nearest its aspect
    ratio, argmin |width/height − w_r/h_r| (ties to the smaller w_r, as the pipeline's `min` over tuples), scaled by
    side/1024 and floored to multiples of 16. At the published side 1024 this is exactly the pipeline's
    auto-resize."""
    ratio = width / height
    _, w, h = min((abs(ratio - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    scale = side / KONTEXT_PUBLISHED_SIZE
    return int(w * scale) // 16 * 16, int(h * scale) // 16 * 16


# ----------------------------------------------------------------------------------------------- adapters
@register_model("flux")
class FluxPolicy(DiffusersPolicy):
    """FLUX.1-dev (guidance embedding) and FLUX.1-schnell (none); the checkpoint's transformer config says which."""

    default_lora_targets = FLUX_LORA_TARGETS
    family = "FLUX.1"

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer",
                                       "text_encoder_2", "tokenizer_2"))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        # T5 overflows in float16 (a T5 trait); bfloat16 has float32's range
        t5_dtype = torch.bfloat16 if self.dtype == torch.float16 else self.dtype
        self.text_encoder_2 = frozen(self.load("text_encoder_2", t5_dtype), device)
        self.tokenizer_2 = self.load("tokenizer_2")
        self.max_sequence_length = int(cfg.max_sequence_length)
        if self.max_sequence_length > MAX_T5_TOKENS:
            raise ValueError(f"model.max_sequence_length={self.max_sequence_length} must be <= {MAX_T5_TOKENS} for "
                             f"{self.family} (FluxPipeline's limit)")
        self.true_cfg_scale = float(cfg.get("true_cfg_scale") or 1.0)
        self._negatives: dict[str, Cond] = {}  # true CFG's negative text conditioning, by text
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_text(self, text: str) -> Cond:
        """T5 tokens (max_sequence_length, D) and CLIP's pooled output (P,), float32."""
        clip_ids = self.tokenizer([text], padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids.to(self.device)
        pooled = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output[0].float()
        t5_ids = self.tokenizer_2([text], padding="max_length", max_length=self.max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids.to(self.device)
        embeds = self.text_encoder_2(t5_ids, output_hidden_states=False)[0][0].float()
        return {"prompt_embeds": embeds, "pooled": pooled}

    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        return self._encode_text(text)

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """True CFG (`model.true_cfg_scale` > 1): the negative prompt's text conditioning; otherwise nothing (the
        embedded guidance needs no shared conditioning). A model without a guidance embedding (schnell) refuses a
        guidance scale."""
        if not self.guidance_embeds and guidance.scale != 1.0:
            raise ValueError(f"{self.family} without a guidance embedding (schnell) has no guidance scale: "
                             f"rollout.guidance_scale={guidance.scale} must be 1.0 (true CFG: model.true_cfg_scale)")
        if self.true_cfg_scale <= 1.0:
            return {}
        text = guidance.negative_prompt
        if text not in self._negatives:  # text only, also for Kontext (whose prompts carry images)
            with torch.no_grad():
                self._negatives[text] = {k: v[None] for k, v in self._encode_text(text).items()}
        return self._negatives[text]

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.vae_scale_factor  # × the 2×2 packing for the size check
        return {"x": (self.transformer.config.in_channels // 4, *image_latent_grid(self.family, shape, f, 2 * f))}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The pipeline's grid for this image size: μ from the noise-token count (ignored by a scheduler without
        dynamic shifting, e.g. schnell's)."""
        _, h, w = self.latent_shapes(shape)["x"]
        return shifted_sigmas(self.scheduler, num_steps, (h // 2) * (w // 2))

    def _condition_tokens(self, cond: Cond) -> torch.Tensor:
        """Per-sample condition tokens of the batch (B,); none for FLUX.1."""
        return torch.zeros(cond["prompt_embeds"].shape[0], dtype=torch.long)

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """The count of one sample, averaged over the batch (Kontext's samples may carry different conditions)."""
        h, w = latents["x"].shape[-2:]
        noise, text = (h // 2) * (w // 2), cond["prompt_embeds"].shape[1]
        per_sample = [flux_forward_flops(self.transformer.config, noise + m, text)
                      for m in self._condition_tokens(cond).tolist()]
        return sum(per_sample) / len(per_sample)

    def _run(self, network, tokens: torch.Tensor, ids: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """One transformer call on packed tokens (B, N, 4C) with their ids (N, 3); returns (B, N, 4C) float32."""
        embeds = cond["prompt_embeds"]
        guidance = cond.get("guidance")
        return network(
            hidden_states=tokens.to(self.dtype),
            timestep=sigma.float(),  # σ, not 1000·σ: the transformer scales by 1000 itself
            guidance=None if guidance is None else guidance.float(),
            pooled_projections=cond["pooled"].to(self.dtype),
            encoder_hidden_states=embeds.to(self.dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=tokens.device),
            img_ids=ids.to(tokens.device),
            return_dict=False,
        )[0].float()

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on unpacked latents: packs 2×2 patches, runs the transformer, unpacks."""
        x = latents["x"]
        h, w = x.shape[-2:]
        out = self._run(network, pack_latents(x.float()), image_ids(h // 2, w // 2), sigma, cond)
        return {"x": unpack_latents(out, h, w)}

    def _with_guidance(self, cond: Cond, scale: float) -> Cond:
        """The conditioning plus the embedded guidance value per sample (guidance-distilled models only)."""
        if not self.guidance_embeds:
            return cond
        b = cond["prompt_embeds"].shape[0]
        return {**cond, "guidance": torch.full((b,), float(scale), device=cond["prompt_embeds"].device)}

    def _pair(self, cond: Cond, shared: Cond) -> Cond:
        """neg ⊕ pos: the shared negative text for every sample, then each sample's own; per-sample entries that
        are not text (Kontext's condition tokens) twice."""
        b = cond["prompt_embeds"].shape[0]
        neg = {k: shared[k].expand(b, *shared[k].shape[1:]) if k in shared else v for k, v in cond.items()}
        return {k: torch.cat([neg[k], v]) for k, v in cond.items()}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """`guidance` is the embedded guidance (ignored without an embedding); with true CFG (a shared negative),
        v_neg + s_true·(v_pos − v_neg) from one batched forward of neg ⊕ pos, both with that embedding."""
        if not shared:
            return self._forward(latents, sigma, self._with_guidance(cond, guidance))
        both = self._forward({k: torch.cat([v, v]) for k, v in latents.items()}, torch.cat([sigma, sigma]),
                             self._with_guidance(self._pair(cond, shared), guidance))
        halves = {k: v.chunk(2) for k, v in both.items()}
        return self._guide({k: h[0] for k, h in halves.items()}, {k: h[1] for k, h in halves.items()},
                           self.true_cfg_scale)

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        cfg = self.vae.config
        z = latents["x"].to(self.device, torch.float32) / cfg.scaling_factor + cfg.shift_factor
        return {"images": (self.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)}

    def _encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [−1, 1] (B, 3, H, W) -> normalised latents (posterior mode = mean), (z − shift)·scale."""
        cfg = self.vae.config
        z = self.vae.encode(pixels.to(self.device, torch.float32)).latent_dist.mode()
        return (z - cfg.shift_factor) * cfg.scaling_factor

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        return {"x": self._encode_pixels(media["images"] * 2 - 1)}


@register_model("flux_kontext")
class FluxKontextPolicy(FluxPolicy):
    """FLUX.1-Kontext-dev: FLUX.1-dev's transformer conditioned on one source image per prompt, whose packed latents
    follow the noise tokens along the sequence. `model.condition_size` scales the trained ≈1024² resolutions
    (`kontext_condition_dims`; null: 1024, the pipeline's own auto-resize)."""

    default_lora_targets = FLUX_KONTEXT_LORA_TARGETS
    family = "FLUX.1-Kontext"
    condition_images = True

    def __init__(self, cfg, device: torch.device):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(cfg, device)
        self.condition_size = int(cfg.get("condition_size") or KONTEXT_PUBLISHED_SIZE)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def _encode_condition(self, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition's packed latent tokens (N_c, 4C) and packed grid (1, 2): resized as the pipeline does
        (`resize`, then `preprocess` to [−1, 1]), VAE posterior mode, normalised, packed."""
        image = load_rgb(path)
        w, h = kontext_condition_dims(*image.size, self.condition_size)
        if not (w and h):
            raise ValueError(f"condition image {path} ({image.size[0]}x{image.size[1]}) at model.condition_size="
                             f"{self.condition_size} gives a {w}x{h} condition: raise model.condition_size")
        pixels = self.image_processor.preprocess(self.image_processor.resize(image, h, w), h, w)
        z = self._encode_pixels(pixels)
        return pack_latents(z)[0], torch.tensor([[z.shape[-2] // 2, z.shape[-1] // 2]])

    def _encode_one(self, prompt: Prompt) -> Cond:
        text, (path,) = condition_paths(prompt, self.family, max_images=1)
        tokens, grid = self._encode_condition(path)
        return {**self._encode_text(text), "condition_latents": tokens, "condition_grids": grid}

    def _collate(self, conds: list[Cond]) -> Cond:
        """Text stacks (fixed length); condition tokens right-padded with zeros (a sample's grid says how many of its
        tokens are real)."""
        import torch.nn.functional as F

        out = {k: torch.stack([c[k] for c in conds]) for k in ("prompt_embeds", "pooled", "condition_grids")}
        rows = max(len(c["condition_latents"]) for c in conds)
        out["condition_latents"] = torch.stack(
            [F.pad(c["condition_latents"], (0, 0, 0, rows - len(c["condition_latents"]))) for c in conds])
        return out

    def _condition_tokens(self, cond: Cond) -> torch.Tensor:
        grids = cond["condition_grids"]
        return (grids[..., 0] * grids[..., 1]).sum(-1)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on unpacked latents: noise tokens ⊕ condition tokens through the transformer, once per distinct
        condition grid (FLUX has no attention mask: samples with other grids cannot share a call); the output's
        noise tokens, unpacked."""
        from .qwen_image_edit import grid_groups

        x = latents["x"]
        h, w = x.shape[-2:]
        noise = pack_latents(x.float())
        outs, order = [], []
        for ((rows, cols),), idx in grid_groups(cond["condition_grids"]).items():
            idx = idx.to(x.device)
            tokens = torch.cat([noise[idx], cond["condition_latents"][idx, : rows * cols].float()], 1)
            ids = torch.cat([image_ids(h // 2, w // 2), image_ids(rows, cols, frame=1)])
            part = {k: v[idx] for k, v in cond.items()}
            outs.append(self._run(network, tokens, ids, sigma[idx], part)[:, : noise.shape[1]])
            order.append(idx)
        out = torch.cat(outs)[torch.argsort(torch.cat(order))]
        return {"x": unpack_latents(out, h, w)}
