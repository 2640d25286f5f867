"""HunyuanImage-2.1 adapter (base and distilled: a FLUX-like double/single-stream DiT over a 32× VAE + flow
matching), loaded from a local diffusers `HunyuanImagePipeline` directory.

Latents: the VAE latent (B, C, H/32, W/32) (`AutoencoderKLHunyuanImage`, C = 64), one transformer token per latent
pixel (patch size 1), as the pipeline samples it.

Facts taken from diffusers' `HunyuanImagePipeline` (0.42.1), which this adapter reproduces:
- Text: the prompt in the Qwen-Image system template *without* the assistant header, through Qwen2.5-VL; the hidden
  state two layers from the top (`hidden_states[-3]`), the template's first 34 tokens dropped, at most 1000 prompt
  tokens. Glyph text: the quoted spans of the prompt ('…', "…", ‘…’, “…”) as `Text "…". ` through ByT5 (T5 encoder,
  128 bytes), or nothing when the prompt quotes nothing. The pipeline pads both to 1000 / 128 tokens with a mask;
  here each prompt keeps its valid tokens and a batch is padded to its longest (masked keys contribute nothing, and
  text tokens carry no position, so the image tokens see exactly the pipeline's keys).
- Timestep: t = 1000·σ; the network predicts v (x_{σ'} = x + (σ' − σ)·v), no sign change.
- Sigmas: linspace(1, 0, N + 1)[:-1] through the scheduler's shift, then σ_N = 0.
- VAE: z = x / scaling_factor (no shift) before decoding; posterior mode · scaling_factor to encode.

Guidance (`rollout.guidance_scale`):
- Distilled (`guidance_embeds`): the scale enters the transformer's guidance embedding as 1000·scale (the pipeline's
  `distilled_guidance_scale`, default 3.25), one forward per step. The distilled model is also a MeanFlow model
  (`use_meanflow`): besides t it takes t_r = 1000·σ_{i+1}, the *next* grid point (0 at the last step), so its output
  is the average velocity over the step. The adapter remembers the grid of its last `sigmas()` call (the rollout and
  the actor both call it for the run's plan) and refuses a σ that is not on it.
- Base: the checkpoint's `guider` (`AdaptiveProjectedMixGuidance`; `ocr_guider` for prompts with glyph text, chosen
  per prompt: the pipeline chooses per batch, so the two agree for a batch of one prompt): classifier-free guidance
  u + s·(c − u) for steps i ≤ `adaptive_projected_guidance_start_step`, adaptive projected guidance (APG, `hunyuan_apg`)
  after, both only for steps in [⌊start·N⌋, ⌊stop·N⌋), then the optional std rescale. s is `rollout.guidance_scale`
  (the guider's `guidance_scale`; the OCR guider keeps its own unless `model.options.ocr_guidance_scale` is set); the
  APG scale, norm threshold and η are the guider's. `rollout.guidance_scale` = 1 turns guidance off for every prompt.
  `model.options.apg=false` runs the CFG branch at every step.

Why the published APG is not reproduced exactly: its guider keeps a momentum buffer m_i = Δ_i + μ·m_{i−1}
(Δ = c − u, μ = −0.5), updated at every guided step, including the CFG ones, and APG projects m_i, not Δ_i. The
guided velocity of step i is then a function of every earlier step's state, not of (x_i, σ_i). A trajectory stores
only its SDE window, and the loss re-evaluates a transition's log-probability under the current weights from
(x_i, σ_i) alone: to reproduce m_i it would have to re-run the network on all earlier states (which are not kept),
and a buffer stored from the rollout would make the training velocity differ from the policy that is being
trained. So polyrl runs the guider's schedule with the momentum dropped (the guider with
`adaptive_projected_guidance_momentum=None`), which the rollout and training compute identically: it equals the
pipeline's guidance at steps 0..start_step (the CFG steps, where the buffer does not enter the output) and differs
from the first APG step on. This is the same choice as ACE-Step's APG (models/ace_step.py).
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserError
from ..latents import Latents, MediaShape
from .base import Cond, Guidance, Media, Prompt, image_latent_grid, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .options import read_options
from .qwen_image import pad_text

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
TEMPLATE_DROP = 34
TEXT_MAX_TOKENS = 1000  # prompt tokens after the dropped header (the pipeline's tokenizer_max_length)
GLYPH_MAX_TOKENS = 128  # ByT5 bytes (the pipeline's tokenizer_2_max_length)
TEXT_LAYER = -3  # hidden_states[-(hidden_state_skip_layer + 1)], skip 2
GLYPH_PROJECTION_HIDDEN = 2048  # HunyuanImageByT5TextProjection's hidden width

# No published RL recipe names HunyuanImage targets: the attention and feed-forward projections of both streams of the
# double-stream blocks (q/k/v/ff also match the text token refiner's), and the single-stream blocks' q/k/v and MLP
# input, as flow_grpo's FLUX.1 list does for the same block layout.
HUNYUAN_IMAGE_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    "proj_mlp",
]
# AdaptiveProjectedMixGuidance's defaults (diffusers 0.42.1): a guider config that omits a key means this value
GUIDER_DEFAULTS = dict(guidance_scale=3.5, guidance_rescale=0.0, adaptive_projected_guidance_scale=10.0,
                       adaptive_projected_guidance_momentum=-0.5, adaptive_projected_guidance_rescale=10.0, eta=0.0,
                       use_original_formulation=False, start=0.0, stop=1.0, adaptive_projected_guidance_start_step=5,
                       enabled=True)


# ----------------------------------------------------------------------------------------------- pure math
def hunyuan_image_forward_flops(config, image_tokens: int, text_tokens: int, glyph_tokens: int) -> float:
    """`HunyuanImageTransformer2DModel`, one sample with N = `image_tokens` latent tokens, T = `text_tokens` Qwen
    tokens and G = `glyph_tokens` ByT5 tokens, S = N + T + G (docs/algorithms.md §6: a matmul is 2·tokens·in·out,
    attention 4·Sq·Sk·d).

    With d = heads·head_dim and r = mlp_ratio: every double-stream block runs q/k/v/out (4d²) and a GELU MLP
    d → rd → d (2rd²) on each stream's own tokens and the joint attention over S; every single-stream block runs the
    fused q/k/v (3d²), the MLP input d → rd and the output (d + rd) → d on all S tokens, the same (4 + 2r)d² per token,
    and the attention; per sample the AdaLN linears d → 6d (twice per double block) and d → 3d (single). The text
    token refiner (T tokens): proj_in (D_text → d), per layer q/k/v/out, a SiLU MLP d → rd → d, self-attention over T
    and an AdaNorm d → 2d per sample; its per-sample embedder (timestep 256 → d → d, pooled text D_text → d → d).
    The ByT5 projection (G tokens): D_byt5 → 2048 → 2048 → d. The time embedder 256 → d → d, one more for t_r
    (MeanFlow) and for the guidance embedding; x_embedder (C·p² → d) and proj_out (d → p²·C_out) on N tokens, the
    output AdaLayerNormContinuous d → 2d.
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    r = c.mlp_ratio
    p2 = int(np.prod(c.patch_size))
    n, t, g = image_tokens, text_tokens, glyph_tokens
    s = n + t + g
    per_token = (4 + 2 * r) * d * d
    flops = (c.num_layers + c.num_single_layers) * (2 * s * per_token + 4 * s * s * d)
    flops += 2 * d * (c.num_layers * 12 * d + c.num_single_layers * 3 * d)
    refiner = 2 * t * (4 * d * d + 2 * r * d * d) + 4 * t * t * d + 2 * d * 2 * d
    flops += c.num_refiner_layers * refiner + 2 * t * c.text_embed_dim * d
    flops += 2 * (256 * d + d * d) + 2 * (c.text_embed_dim * d + d * d)
    if c.text_embed_2_dim is not None and g:
        h = GLYPH_PROJECTION_HIDDEN
        flops += 2 * g * (c.text_embed_2_dim * h + h * h + h * d)
    embedders = 1 + bool(c.use_meanflow) + bool(c.guidance_embeds)
    flops += embedders * 2 * (256 * d + d * d)
    flops += 2 * n * c.in_channels * p2 * d + 2 * n * d * p2 * c.out_channels + 2 * d * 2 * d
    return float(flops)


def hunyuan_apg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, eta: float,
                norm_threshold: float) -> torch.Tensor:
    """Adaptive projected guidance as HunyuanImage's guider runs it without momentum (Sadat et al. 2024, "Eliminating
    Oversaturation and Artifacts of High Guidance Scales in Diffusion Models"; diffusers' `normalized_guidance`), per
    sample over all its elements:

        Δ = v_c − v_u,  Δ ← Δ·min(1, τ/‖Δ‖) (τ > 0),  v̂_c = v_c/‖v_c‖,  Δ∥ = ⟨Δ, v̂_c⟩·v̂_c,  Δ⊥ = Δ − Δ∥,
        v = v_u + s·(Δ⊥ + η·Δ∥),

    the projection in float64, as diffusers computes it."""
    dims = tuple(range(1, v_cond.ndim))
    diff = v_cond - v_uncond
    if norm_threshold > 0:
        norm = torch.linalg.vector_norm(diff, dim=dims, keepdim=True)
        diff = diff * torch.minimum(torch.ones_like(norm), norm_threshold / norm)
    unit = F.normalize(v_cond.double().flatten(1), dim=1).view_as(v_cond)
    parallel = (diff.double() * unit).sum(dims, keepdim=True) * unit
    orthogonal = diff.double() - parallel
    return v_uncond + scale * (orthogonal.to(diff.dtype) + eta * parallel.to(diff.dtype))


def std_rescale(guided: torch.Tensor, v_cond: torch.Tensor, phi: float) -> torch.Tensor:
    """The guider's `guidance_rescale` φ (Lin et al. 2023 §3.4): φ·v·std(v_c)/std(v) + (1 − φ)·v, std per sample."""
    dims = list(range(1, guided.ndim))
    rescaled = guided * (v_cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return phi * rescaled + (1 - phi) * guided


# ----------------------------------------------------------------------------------------------- adapter
@register_model("hunyuan_image")
class HunyuanImagePolicy(DiffusersPolicy):
    default_lora_targets = HUNYUAN_IMAGE_LORA_TARGETS
    family = "HunyuanImage"
    # `model.options` keys and defaults (config validation refuses other keys)
    options = {
        "apg": True,  # base: the guider's APG after its start step (momentum dropped); false: CFG at every step
        "ocr_guidance_scale": None,  # base, prompts with glyph text: the OCR guider's CFG scale; null: the checkpoint's
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler", "text_encoder", "tokenizer",
                                       "text_encoder_2", "tokenizer_2"))
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        self.text_encoder_2 = frozen(self.load("text_encoder_2", self.dtype), device)
        self.tokenizer_2 = self.load("tokenizer_2")
        self.spatial_factor = int(self.vae.config.spatial_compression_ratio)
        self.guiders = {name: self._guider(name) for name in ("guider", "ocr_guider")}
        if self.guidance_embeds and any(self.guiders.values()):
            raise UserError(f"{self.root}: a guidance-distilled HunyuanImage (guidance_embeds) with an enabled guider "
                            "component: CFG on top of the guidance embedding is not supported")
        self._grid: torch.Tensor | None = None  # the last `sigmas()` grid: MeanFlow's t_r and the guider's step index

    def _guider(self, name: str) -> dict | None:
        """An enabled `AdaptiveProjectedMixGuidance` component's settings (its config over the class defaults), or
        None. model_index.json may list a guider without a library (diffusers writes [null, null]): the folder counts."""
        path = self.root / name / "guider_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        if config.get("_class_name", "AdaptiveProjectedMixGuidance") != "AdaptiveProjectedMixGuidance":
            raise UserError(f"{path}: guider class {config['_class_name']!r}; HunyuanImage's is AdaptiveProjectedMixGuidance")
        settings = {k: config.get(k, v) for k, v in GUIDER_DEFAULTS.items()}
        if settings["use_original_formulation"]:
            raise UserError(f"{path}: use_original_formulation=true is not supported (HunyuanImage's guiders use false)")
        return settings if settings["enabled"] else None

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    @property
    def use_meanflow(self) -> bool:
        return bool(self.transformer.config.use_meanflow)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        """Qwen2.5-VL valid-token states (T, D) and ByT5 glyph states (G, D₂), G = 0 without quoted text; float32."""
        from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

        (text,) = text_only([prompt], self.family)
        tok = self.tokenizer([PROMPT_TEMPLATE.format(text)], max_length=TEXT_MAX_TOKENS + TEMPLATE_DROP,
                             truncation=True, return_tensors="pt").to(self.device)
        out = self.text_encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True)
        embeds = out.hidden_states[TEXT_LAYER][0][tok.attention_mask[0].bool()][TEMPLATE_DROP:].float()
        if embeds.shape[0] == 0:
            raise ValueError(f"prompt {text!r} encodes to no tokens after the template's first {TEMPLATE_DROP}")
        glyph_text = extract_glyph_text(text)
        width = self.text_encoder_2.config.d_model
        glyph = torch.zeros(0, width, device=self.device)
        if glyph_text is not None:
            g = self.tokenizer_2(glyph_text, padding="max_length", max_length=GLYPH_MAX_TOKENS, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").to(self.device)
            states = self.text_encoder_2(input_ids=g.input_ids, attention_mask=g.attention_mask.float())[0]
            glyph = states[0][g.attention_mask[0].bool()].float()
        return {"prompt_embeds": embeds, "glyph_embeds": glyph}

    def _collate(self, conds: list[Cond]) -> Cond:
        """Both token sequences right-padded to the longest of the call, each with its bool mask."""
        embeds, mask = pad_text([c["prompt_embeds"] for c in conds])
        glyph, glyph_mask = pad_text([c["glyph_embeds"] for c in conds])
        return {"prompt_embeds": embeds, "prompt_mask": mask, "glyph_embeds": glyph, "glyph_mask": glyph_mask}

    @staticmethod
    def _repad(cond: Cond, text: int, glyph: int) -> Cond:
        out = dict(cond)
        for embeds, mask, length in (("prompt_embeds", "prompt_mask", text), ("glyph_embeds", "glyph_mask", glyph)):
            extra = length - cond[embeds].shape[1]
            out[embeds] = F.pad(cond[embeds], (0, 0, 0, extra))
            out[mask] = F.pad(cond[mask], (0, extra), value=False)
        return out

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """Base with a guider: the negative prompt's conditioning when the scale is not 1; the distilled model and a
        checkpoint without guider need none."""
        if self.guidance_embeds or not any(self.guiders.values()) or guidance.scale == 1.0:
            return {}
        return self.encode_prompts([guidance.negative_prompt])

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.spatial_factor  # × the transformer's patch for the size check
        multiple = f * int(self.transformer.config.patch_size[0])
        return {"x": (self.transformer.config.in_channels, *image_latent_grid(self.family, shape, f, multiple))}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The pipeline's grid, remembered for MeanFlow's next σ and the guider's step index."""
        self.latent_shapes(shape)
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
        self._grid = self.scheduler.sigmas.float().cpu()
        return self._grid.clone()

    def step_index(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each σ's step i on the last `sigmas()` grid (σ = σ_i exactly); a σ off the grid is an error."""
        if self._grid is None:
            raise ValueError(f"{self.family}: sigmas() must be called before velocity() (the step index comes from it)")
        match = sigma.detach().float().cpu().view(-1, 1) == self._grid[:-1].view(1, -1)
        if not bool(match.any(1).all()):
            raise ValueError(f"{self.family}: σ={sigma.tolist()} is not on the {len(self._grid) - 1}-step grid of the last "
                             "sigmas() call; MeanFlow's next timestep and the guider's schedule are defined per grid step")
        return match.float().argmax(1)

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """The mean over the batch's samples of their valid text and glyph tokens (batch padding is not counted)."""
        h, w = latents["x"].shape[-2:]
        p2 = int(np.prod(self.transformer.config.patch_size))
        text, glyph = cond["prompt_mask"].sum(1).tolist(), cond["glyph_mask"].sum(1).tolist()
        return sum(hunyuan_image_forward_flops(self.transformer.config, h * w // p2, int(t), int(g))
                   for t, g in zip(text, glyph, strict=True)) / len(text)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        x = latents["x"]
        glyph = cond["glyph_embeds"]
        use_glyph = glyph.shape[1] > 0 and network.config.text_embed_2_dim is not None
        timestep_r = None
        if self.use_meanflow:
            timestep_r = (self._grid.to(sigma.device)[self.step_index(sigma).to(sigma.device) + 1] * 1000).to(self.dtype)
        out = network(
            hidden_states=x.float().to(self.dtype),
            timestep=(sigma.float() * 1000).to(self.dtype),
            timestep_r=timestep_r,
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            encoder_attention_mask=cond["prompt_mask"],
            encoder_hidden_states_2=glyph.to(self.dtype) if use_glyph else None,
            encoder_attention_mask_2=cond["glyph_mask"] if use_glyph else None,
            guidance=cond.get("guidance"),
            return_dict=False,
        )[0]
        return {"x": out.float()}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """Distilled: `guidance` is the embedding (one forward). Base: the guider's CFG / APG (module docstring) for
        the samples whose step it guides, from one forward of the batch ⊕ those samples with the negative prompt."""
        if self.guidance_embeds:
            b = sigma.shape[0]
            scale = torch.full((b,), float(guidance), dtype=self.dtype, device=sigma.device) * 1000.0
            return self._forward(latents, sigma, {**cond, "guidance": scale})
        if not shared or guidance == 1.0:
            return self._forward(latents, sigma, cond)
        plans = self._guidance_plan(sigma, cond, float(guidance))
        index = torch.tensor([i for i, p in enumerate(plans) if p is not None], dtype=torch.long, device=sigma.device)
        if index.numel() == 0:
            return self._forward(latents, sigma, cond)
        b, k = sigma.shape[0], index.numel()
        text = max(cond["prompt_embeds"].shape[1], shared["prompt_embeds"].shape[1])
        glyph = max(cond["glyph_embeds"].shape[1], shared["glyph_embeds"].shape[1])
        pos = self._repad(cond, text, glyph)
        neg = {name: v.expand(k, *v.shape[1:]) for name, v in self._repad(shared, text, glyph).items()}
        both = self._forward({name: torch.cat([v, v[index]]) for name, v in latents.items()},
                             torch.cat([sigma, sigma[index]]), {name: torch.cat([pos[name], neg[name]]) for name in pos})
        out = {}
        for name, v in both.items():
            v_cond, v_uncond = v[:b], v[b:]
            mixed = v_cond.clone()
            for j, i in enumerate(index.tolist()):
                mixed[i] = self._guide_one(v_cond[i : i + 1], v_uncond[j : j + 1], plans[i])[0]
            out[name] = mixed
        return out

    def _guidance_plan(self, sigma: torch.Tensor, cond: Cond, scale: float) -> list[dict | None]:
        """Per sample: None (unguided at its step) or {"scale", "apg", the guider's settings} (the OCR guider's for a
        prompt with glyph text, falling back to the main one as the pipeline does)."""
        steps = self.step_index(sigma).tolist()
        num_steps = len(self._grid) - 1
        plans = []
        for i, has_glyph in zip(steps, cond["glyph_mask"].any(1).tolist(), strict=True):
            use_ocr = has_glyph and self.guiders["ocr_guider"] is not None
            g = self.guiders["ocr_guider"] if use_ocr else self.guiders["guider"]
            if g is None:
                plans.append(None)
                continue
            s = scale
            if use_ocr:
                s = self.opts["ocr_guidance_scale"] if self.opts["ocr_guidance_scale"] is not None else g["guidance_scale"]
            in_range = int(g["start"] * num_steps) <= i < int(g["stop"] * num_steps)
            if not in_range or np.isclose(s, 1.0):
                plans.append(None)
                continue
            apg = (self.opts["apg"] and i > g["adaptive_projected_guidance_start_step"]
                   and not np.isclose(g["adaptive_projected_guidance_scale"], 1.0))
            plans.append({**g, "scale": s, "apg": apg})
        return plans

    @staticmethod
    def _guide_one(v_cond: torch.Tensor, v_uncond: torch.Tensor, plan: dict) -> torch.Tensor:
        if plan["apg"]:
            guided = hunyuan_apg(v_cond, v_uncond, plan["adaptive_projected_guidance_scale"], plan["eta"],
                                 plan["adaptive_projected_guidance_rescale"])
        else:
            guided = v_uncond + plan["scale"] * (v_cond - v_uncond)
        if plan["guidance_rescale"] > 0:
            guided = std_rescale(guided, v_cond, plan["guidance_rescale"])
        return guided

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        z = latents["x"].to(self.device, torch.float32) / self.vae.config.scaling_factor
        return {"images": (self.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        z = self.vae.encode(media["images"].to(self.device, torch.float32) * 2 - 1).latent_dist.mode()
        return {"x": z * self.vae.config.scaling_factor}
