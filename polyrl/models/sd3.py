"""Stable Diffusion 3 / 3.5 adapter (MM-DiT + flow matching), loaded from a local diffusers directory.

Components are loaded one by one with `from_pretrained(path, subfolder=...)` as listed in `model_index.json`, so
a checkpoint may ship any subset of the three text encoders (CLIP-L, CLIP-G, T5): missing CLIP features and
pooled embeddings are zero-filled to the transformer's widths, and a missing T5 contributes no tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..latents import Latents, MediaShape
from .base import Cond, Media, Prompt, image_latent_grid, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .shared_input_lora import shared_input_projections

SD3_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]

# actor.backend=fsdp2 (distributed/plan.py): each joint block is an FSDP / checkpointing unit. Sequence parallel splits
# the image tokens after the patch embedder and the text tokens after the context embedder (the joint attention sees
# image then text; SD3.5's second attention the image only) and gathers the image after proj_out. Tensor parallel
# splits the heads (q/k/v column-wise, outputs row-wise) and the MLPs; the per-head q/k norms see local heads only.
SD3_PARALLEL_PLAN = {"transformer": {
    "blocks": "transformer_blocks", "heads": "num_attention_heads",
    "sequence": {"split": {"pos_embed": "image", "context_embedder": "text"}, "gather": {"proj_out": "image"},
                 "attention": {"attn": ["image", "text"], "attn2": ["image"]}},
    "tensor": {"colwise": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                           "attn.add_v_proj", "attn2.to_q", "attn2.to_k", "attn2.to_v", "ff.net.0.proj",
                           "ff_context.net.0.proj"],
               "rowwise": ["attn.to_out.0", "attn.to_add_out", "attn2.to_out.0", "ff.net.2", "ff_context.net.2"],
               "heads": ["attn", "attn2"],
               "local_grads": ["attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k", "attn2.norm_q",
                               "attn2.norm_k"]},
}}


def sd3_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """SD3 / SD3.5 MM-DiT (`SD3Transformer2DModel`), one sample with `image_tokens` patches and `text_tokens`
    (docs/algorithms.md §6: a matmul is 2·tokens·in·out, joint attention 4·S²·d, per-sample layers once).

    Per joint block: image stream q/k/v/out (4d²) + MLP (8d²) per image token, text stream the same per text
    token (the last block is context-pre-only: text q/k/v only), joint attention over N+T tokens; SD3.5's dual
    blocks add a second image-only attention (4d² per image token + 4·N²·d). Plus patch embedding, caption
    projection, output projection and the per-sample modulation linears.
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, layers = image_tokens, text_tokens, c.num_layers
    dual = set(getattr(c, "dual_attention_layers", ()) or ())
    p2 = c.patch_size**2
    per_sample = 2 * (256 * d + d * d + c.pooled_projection_dim * d + d * d)  # timestep + pooled-text embedders
    flops = 2 * n * c.in_channels * p2 * d + 2 * t * c.joint_attention_dim * d  # patchify, caption projection
    for i in range(layers):
        last = i == layers - 1
        image_params = 12 * d * d + (4 * d * d if i in dual else 0)
        text_params = (3 if last else 12) * d * d
        flops += 2 * n * image_params + 2 * t * text_params
        flops += 4 * (n + t) ** 2 * d + (4 * n * n * d if i in dual else 0)
        per_sample += 2 * d * ((9 if i in dual else 6) * d + (2 if last else 6) * d)  # AdaLN-Zero(-X) linears
    per_sample += 2 * d * 2 * d  # output AdaLayerNormContinuous
    flops += 2 * n * d * p2 * c.out_channels  # proj_out
    return float(flops + per_sample)


def _tokenize(tokenizer, prompts: list[str], max_length: int, device) -> torch.Tensor:
    out = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return out.input_ids.to(device)


def encode_sd3_prompts(text_encoders, tokenizers, prompts: list[str], transformer_config, max_sequence_length: int) -> Cond:
    """SD3 conditioning: CLIP penultimate hidden states (concatenated on features, zero-padded to the joint width)
    followed by T5 tokens on the sequence axis; pooled = concatenated CLIP projections, zero-padded."""
    clip_hidden, pooled = [], []
    for model, tok in zip(text_encoders[:2], tokenizers[:2], strict=False):
        if model is None:
            continue
        ids = _tokenize(tok, prompts, min(tok.model_max_length, 77), model.device)
        out = model(ids, output_hidden_states=True)
        pooled.append(out.text_embeds.float())
        clip_hidden.append(out.hidden_states[-2].float())
    if len(clip_hidden) == 2 and clip_hidden[0].shape[1] != clip_hidden[1].shape[1]:
        raise ValueError("the two CLIP tokenizers pad to different lengths")
    joint, pooled_dim = transformer_config.joint_attention_dim, transformer_config.pooled_projection_dim
    embeds = F.pad(torch.cat(clip_hidden, dim=-1), (0, joint - sum(h.shape[-1] for h in clip_hidden)))
    pooled = F.pad(torch.cat(pooled, dim=-1), (0, pooled_dim - sum(p.shape[-1] for p in pooled)))
    if text_encoders[2] is not None:
        tok = tokenizers[2]
        ids = _tokenize(tok, prompts, min(max_sequence_length, tok.model_max_length), text_encoders[2].device)
        t5 = text_encoders[2](ids).last_hidden_state.float()
        embeds = torch.cat([embeds, F.pad(t5, (0, joint - t5.shape[-1]))], dim=1)
    return {"prompt_embeds": embeds, "pooled": pooled}


class JointAttention:
    """SD3's joint attention (diffusers' `JointAttnProcessor2_0`, same math) without its layout copies.

    diffusers moves q, k, v of the image and the text tokens to (B, H, S, D) and concatenates them there, so each
    of q, k, v is copied into a new (B, H, S, D) tensor. Here the projections stay (B, S, H, D) views, the
    concatenation along the sequence is the one copy, and attention reads the transposed views: flash / cuDNN
    attention take (B, S, H, D) strides natively and write their output in that order, so the reshape back to
    (B, S, H·D) is a view too. The q/k RMS norms act on the last dimension, so the layout does not change them.
    With LoRA on the q/k/v projections their A matrices run as one matmul (models/shared_input_lora.py).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        def heads(x: torch.Tensor) -> torch.Tensor:  # (B, S, H·D) -> (B, S, H, D), a view
            return x.unflatten(-1, (attn.heads, -1))

        image_tokens = hidden_states.shape[1]
        q, k, v = map(heads, shared_input_projections([attn.to_q, attn.to_k, attn.to_v], hidden_states))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if encoder_hidden_states is not None:
            cq, ck, cv = map(heads, shared_input_projections([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj],
                                                             encoder_hidden_states))
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).flatten(2).to(q.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image, text = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return attn.to_out[1](attn.to_out[0](image)), text


def use_joint_attention(transformer: torch.nn.Module) -> None:
    """Swap diffusers' joint attention processors for `JointAttention` (same math, fewer copies); others stay."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    processors = transformer.attn_processors
    transformer.set_attn_processor({name: JointAttention() if type(p) is JointAttnProcessor2_0 else p
                                    for name, p in processors.items()})


@register_model("sd3")
class SD3Policy(DiffusersPolicy):
    default_lora_targets = SD3_LORA_TARGETS
    parallel_plan = SD3_PARALLEL_PLAN
    family = "SD3"

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("transformer", "vae", "scheduler"))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        use_joint_attention(self.transformer)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.scheduler = self.load("scheduler")
        self.text_encoders, self.tokenizers = [], []
        for enc, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3")):
            model = self.load(enc, self.dtype)
            self.text_encoders.append(None if model is None else frozen(model, device))
            self.tokenizers.append(None if model is None else self.load(tok))
        if self.text_encoders[0] is None and self.text_encoders[1] is None:
            raise ValueError(f"{self.root}: SD3 needs at least one CLIP text encoder (text_encoder or text_encoder_2)")
        # every decode call has the rollout chunk's shape: compiled (with NHWC convolutions on the GPU) the decoder
        # runs 2.7x faster; NHWC without compiling is 11% slower than NCHW (docs/performance.md, VAE decode)
        compiled = getattr(cfg, "compile", "none") != "none"
        self.vae_memory_format = torch.channels_last if compiled and device.type == "cuda" else torch.contiguous_format
        self.vae.to(memory_format=self.vae_memory_format)
        if compiled:
            self.vae.decoder.compile()
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        enc = encode_sd3_prompts(self.text_encoders, self.tokenizers, [text], self.transformer.config,
                                 self.max_sequence_length)
        return {k: enc[k][0] for k in ("prompt_embeds", "pooled")}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f, p = self.vae_scale_factor, self.transformer.config.patch_size
        return {"x": (self.transformer.config.in_channels, *image_latent_grid(self.family, shape, f, f * p))}

    def sigmas(self, num_steps: int, shape: MediaShape | None = None) -> torch.Tensor:
        # SD3's shift does not depend on the image size
        self.scheduler.set_timesteps(num_steps)
        return self.scheduler.sigmas.float().cpu()

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        p = self.transformer.config.patch_size
        x = latents["x"]
        return sd3_forward_flops(self.transformer.config, (x.shape[-2] // p) * (x.shape[-1] // p),
                                 cond["prompt_embeds"].shape[1])

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        out = network(
            hidden_states=latents["x"].to(self.dtype),
            timestep=sigma.float() * 1000,  # float32: bf16 would round 1000·σ to ~4 units
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            pooled_projections=cond["pooled"].to(self.dtype),
            return_dict=False,
        )[0]
        return {"x": out}

    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        cfg = self.vae.config
        z = latents["x"].float() / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        # decoding only feeds the reward: with a low-precision network it runs in that precision too (≈3× faster)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            images = self.vae.decode(z.contiguous(memory_format=self.vae_memory_format), return_dict=False)[0]
        return {"images": (images.float() / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        cfg = self.vae.config
        z = self.vae.encode(media["images"].to(self.device) * 2 - 1).latent_dist.mean
        return {"x": (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor}
